"""Loading weights: a Hugging Face directory or a `jaxpaged-convert` directory -> params / Llama.

1. `load_params` tells the two apart by the `jaxpaged_format.json` marker the converter writes.
2. HF: names are validated against the explicit key map (`jaxpaged.checkpoint.hf_keys`) from headers alone
   (missing, unexpected, duplicate and wrongly shaped tensors fail before any data is read);
   then tensors are read one at a time, cast to the target dtype and put into our layout.
3. Converted: the Orbax `params/` tree is restored and checked against the same map.
4. `load_model` builds the NNX `Llama` abstractly (no random init) and fills it with the params.

Peak host memory is about one copy of the model in the target dtype plus one tensor.
"""

import json
import os
from collections.abc import Set as AbstractSet
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxpaged.checkpoint.format import FORMAT_FILE, FORMAT_VERSION, PARAMS_DIR
from jaxpaged.checkpoint.hf_keys import Path, check_shape, format_names, hf_key_specs, optional_hf_keys, param_shapes
from jaxpaged.checkpoint.safetensors_index import SafetensorsCheckpoint
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.presets import load_config_dict
from jaxpaged.model.llama import Llama

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}

Params = dict[str, Any]  # nested dict of numpy arrays, `nnx.state(Llama).to_pure_dict()` layout


def resolve_dtype(dtype: Any, checkpoint_dtype: str | None = None) -> np.dtype:
    """The numpy dtype for a `dtype` argument.

    Args:
      dtype: "auto", "float32", "bfloat16", "float16", or a numpy/jnp dtype of those.
      checkpoint_dtype: what "auto" means (config.json's `dtype`/`torch_dtype`, or a
        converted checkpoint's dtype); float32 when None.

    Raises:
      ValueError: naming the unsupported value.
    """
    if isinstance(dtype, str) and dtype == "auto":
        if checkpoint_dtype is None:
            return DTYPES["float32"]
        name = checkpoint_dtype.removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(
                f"dtype='auto' resolves to the checkpoint's dtype {checkpoint_dtype!r}, which is not "
                f"supported; pass dtype= one of {sorted(DTYPES)}"
            )
        return DTYPES[name]
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not supported; use 'auto' or one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    try:
        resolved = np.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved not in DTYPES.values():
        raise ValueError(f"dtype={dtype!r} is not supported; use 'auto' or one of {sorted(DTYPES)}")
    return resolved


def dtype_name(dtype: np.dtype) -> str:
    """The name ("float32", "bfloat16" or "float16") of a resolved dtype."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def is_converted_dir(model_dir: str | os.PathLike) -> bool:
    """Whether `model_dir` was written by `jaxpaged-convert` (holds the format marker)."""
    return os.path.isfile(os.path.join(model_dir, FORMAT_FILE))


def read_hf_config(model: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    """`(ModelConfig, raw config.json dict)` of a model directory or a preset name.

    Raises:
      ValueError: neither a preset nor a directory with config.json, or an unsupported
        configuration (from `ModelConfig.from_hf`).
    """
    _, raw = load_config_dict(os.fspath(model))
    return ModelConfig.from_hf(raw), raw


def check_names(expected: AbstractSet, present: AbstractSet, where: str, optional: AbstractSet = frozenset()) -> None:
    """Raises ValueError listing every missing and every unexpected name (sorted, truncated)."""
    missing = expected - present
    unexpected = present - expected - optional
    problems = []
    if missing:
        problems.append(f"missing keys: {format_names(map(_dotted, missing))}")
    if unexpected:
        problems.append(f"unexpected keys: {format_names(map(_dotted, unexpected))}")
    if problems:
        raise ValueError(f"{where} does not match config.json: " + "; ".join(problems))


def read_hf_params(
    model_dir: str | os.PathLike, config: ModelConfig, dtype: np.dtype, progress: bool = False
) -> Params:
    """Reads and converts an HF safetensors checkpoint, tensor by tensor.

    Args:
      model_dir: directory with `model.safetensors` or `model.safetensors.index.json` + shards.
      config: the model configuration (from the same directory's config.json).
      dtype: target numpy dtype of every parameter.
      progress: show a tqdm bar over tensors.

    Returns:
      The nested params dict in our layout.

    Raises:
      ValueError: missing, unexpected, duplicate or wrongly shaped tensors, each named.
    """
    ckpt = SafetensorsCheckpoint(model_dir)
    specs = hf_key_specs(config)
    optional = optional_hf_keys(config)
    check_names({s.hf_name for s in specs}, set(ckpt.names), f"checkpoint {os.fspath(model_dir)!r}", set(optional))
    for spec in specs:  # from headers, before reading any data
        check_shape(spec.hf_name, spec.hf_shape, ckpt.shape(spec.hf_name))
    for name, shape in optional.items():
        if shape is not None and name in ckpt.locations:
            check_shape(name, shape, ckpt.shape(name))
    by_name = {s.hf_name: s for s in specs}
    params: Params = {}
    with tqdm(total=len(specs), desc="loading tensors", unit="tensor", disable=not progress) as bar:
        for name, array in ckpt.iter_tensors(by_name):
            spec = by_name[name]
            _insert(params, spec.target, spec.transform(array.astype(dtype, copy=False)))
            del array
            bar.update()
    return params


def load_params(model_dir: str | os.PathLike, dtype: Any = "auto") -> tuple[ModelConfig, Params]:
    """Loads the parameters of an HF directory or a converted directory as numpy arrays.

    Args:
      model_dir: an HF directory (config.json + safetensors) or one written by jaxpaged-convert.
      dtype: "auto" (the checkpoint's dtype; float32 when config.json names none), "float32",
        "bfloat16", "float16" or an equivalent numpy/jnp dtype.

    Returns:
      `(config, params)`: params is a nested dict (layer indices are int keys) matching
      `nnx.state(Llama(config)).to_pure_dict()`.

    Raises:
      FileNotFoundError: no config.json or no checkpoint files.
      ValueError: unsupported config or dtype; missing, unexpected, duplicate or misshaped keys.
    """
    config, raw = read_hf_config(model_dir)
    if is_converted_dir(model_dir):
        return config, _load_converted(model_dir, config, dtype)
    target = resolve_dtype(dtype, raw.get("dtype") or raw.get("torch_dtype"))
    return config, read_hf_params(model_dir, config, target)


def load_model(model_dir: str | os.PathLike, dtype: Any = "auto", attention: str = "auto") -> tuple[ModelConfig, Llama]:
    """Loads a checkpoint into an NNX `Llama` without random-initialising it first.

    Args:
      model_dir: an HF directory or a converted directory (see `load_params`).
      dtype: as in `load_params`; also the model's dtype.
      attention: attention backend, "auto", "reference" or "pallas".

    Returns:
      `(config, model)` whose parameters are `jax.Array`s on the default device.
    """
    config, params = load_params(model_dir, dtype)
    param_dtype = params["embed"].dtype
    abstract = nnx.eval_shape(lambda: Llama(config, param_dtype, rngs=nnx.Rngs(0), attention=attention))
    graphdef, state = nnx.split(abstract)
    _to_device(params)
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    leftover = [leaf for leaf in jax.tree.leaves(nnx.state(model)) if not isinstance(leaf, jax.Array)]
    if leftover:
        raise RuntimeError(f"{len(leftover)} model variables were not filled from the checkpoint")
    return config, model


def _load_converted(model_dir: str | os.PathLike, config: ModelConfig, dtype: Any) -> Params:
    import orbax.checkpoint as ocp  # only converted checkpoints need Orbax

    with open(os.path.join(model_dir, FORMAT_FILE)) as f:
        marker = json.load(f)
    if marker.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{FORMAT_FILE} in {os.fspath(model_dir)!r} has format_version={marker.get('format_version')!r}; "
            f"this jaxpaged reads version {FORMAT_VERSION}: re-run jaxpaged-convert"
        )
    target = resolve_dtype(dtype, marker.get("dtype"))
    params_dir = os.path.abspath(os.path.join(model_dir, PARAMS_DIR))
    if not os.path.isdir(params_dir):
        raise FileNotFoundError(f"converted checkpoint {os.fspath(model_dir)!r} has no {PARAMS_DIR}/ directory")
    expected = param_shapes(config)
    with ocp.PyTreeCheckpointer() as checkpointer:
        # Names and shapes from the metadata first; then read as numpy, cast while reading.
        meta = checkpointer.metadata(params_dir)
        meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
        stored = {path: tuple(m.shape) for path, m in _flatten(meta).items()}
        check_names(set(expected), set(stored), f"converted checkpoint {params_dir!r}")
        for path, shape in stored.items():
            check_shape(_dotted(path), expected[path], shape)
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray, dtype=target), meta)
        restored = checkpointer.restore(params_dir, restore_args=args)
    params: Params = {}
    for path, array in _flatten(restored).items():
        _insert(params, path, np.asarray(array))
    return params


def _dotted(key: str | Path) -> str:
    """An HF name as is; a params path as `layers.0.attn.q_proj`."""
    return key if isinstance(key, str) else ".".join(map(str, key))


def _insert(tree: dict, path: Path, value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _flatten(tree: dict, prefix: Path = ()) -> dict[Path, Any]:
    """Nested dict -> {path: leaf}; digit-string keys (Orbax stores layer indices so) become ints."""
    flat = {}
    for key, value in tree.items():
        key = int(key) if isinstance(key, str) and key.isdigit() else key
        if isinstance(value, dict):
            flat.update(_flatten(value, prefix + (key,)))
        else:
            flat[prefix + (key,)] = value
    return flat


def _to_device(tree: dict) -> None:
    """Replaces every numpy leaf by a `jax.Array` in place, freeing each host copy as it goes."""
    for key, value in tree.items():
        if isinstance(value, dict):
            _to_device(value)
        else:
            tree[key] = jax.device_put(value)
