"""Loading weights: a Hugging Face directory or a `jaxpaged-convert` directory -> params / Llama.

1. `load_params` tells the two apart by the `jaxpaged_format.json` marker the converter writes.
2. HF: names are validated against the explicit key map (`jaxpaged.checkpoint.hf_keys`) from headers alone
   (missing, unexpected, duplicate, wrongly shaped and wrongly typed tensors fail before any data
   is read); then tensors are read one at a time, cast to the target dtype and put into our layout.
3. Converted: the Orbax `params/` tree is restored and checked against the same map.
4. `load_model` builds the NNX `Llama` abstractly (no random init) and fills it tensor by
   tensor, each placed on its devices (split by the sharding table under tensor parallelism);
   a decoder layer's tensor becomes that layer's array (unrolled layers: `LayerArrays`), or goes
   into its row of the stacked parameter, in place on the device (scanned layers).

Weight quantization (`quantization` fp8/int8, `jaxpaged.model.quant`; int4 in groups,
`jaxpaged.model.group_quant`) comes two ways:

- a plain checkpoint is quantized by `load_model` as each weight is read (`_quantize_tensors`):
  its pair, or (int4, `quantization_group_size`) its group-quantized triple, made on the device;
- a pre-quantized one (compressed-tensors FP8: config.json's `quantization_config`, see
  `jaxpaged.config.quantization.checkpoint_quantization`) already holds the quantized pairs: its
  key map targets `<name>_quant` (float8_e4m3fn, bytes kept) and `<name>_scale` (float32) directly
  (see `hf_keys`), they are exempt from the `dtype` cast, and nothing is quantized again. Its
  method is the model's whatever `quantization` says (a different one is refused); a converted
  directory of such a checkpoint keeps its config.json and so reads the same way. A 4/8-bit
  group-quantized format (AWQ, GPTQ, compressed-tensors pack-quantized) plugs in as a
  `jaxpaged.checkpoint.group_state.LinearReader` (an HF projection's prefix -> its
  `GroupQuantized`): `group_state.group_tensors(config, reader)` yields its projections' triples,
  the other tensors read as plain ones.

Peak host memory: about one tensor from safetensors; one copy of the model from Orbax (which
restores the whole tree before placing it). Device memory: the model plus one layer's tensor.
"""

import functools
import json
import logging
import os
from collections.abc import Iterator
from collections.abc import Set as AbstractSet
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from tqdm import tqdm

from jaxpaged.checkpoint.experts import stack_experts
from jaxpaged.checkpoint.format import FORMAT_FILE, FORMAT_VERSION, PARAMS_DIR
from jaxpaged.checkpoint.formats import linear_reader, quantized_linears
from jaxpaged.checkpoint.group_state import group_tensors
from jaxpaged.checkpoint.hf_keys import (
    Path,
    by_name,
    check_shape,
    format_names,
    hf_key_specs,
    kept_dtype,
    optional_hf_keys,
    param_shapes,
    quantizable,
)
from jaxpaged.checkpoint.safetensors_index import SafetensorsCheckpoint
from jaxpaged.config import defaults
from jaxpaged.config.architectures import ARCHITECTURES
from jaxpaged.config.group_formats import GROUP_FORMATS, GroupFormat
from jaxpaged.config.hf_config import model_config_from_hf
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.quantized import with_quantized_weights
from jaxpaged.config.params.spec import LAYER_STACK
from jaxpaged.config.params.tables import find_state_param, quantized_paths
from jaxpaged.config.presets import load_config_dict
from jaxpaged.config.quantization import DEFAULT_GROUP_SIZE, StoredWeights, resolve_quantization, stored_weights
from jaxpaged.model.group_quant import code_dtype
from jaxpaged.model.layer_arrays import LayerArrays, unstack_layers
from jaxpaged.model.llama import Llama
from jaxpaged.model.quant import quantize_param
from jaxpaged.parallel.mesh import TensorParallel, param_path

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}

Params = dict[str, Any]  # nested dict of numpy arrays, `nnx.state(Llama).to_pure_dict()` layout

logger = logging.getLogger("jaxpaged")


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
        configuration (from `model_config_from_hf`).
    """
    _, raw = load_config_dict(os.fspath(model))
    return model_config_from_hf(raw), raw


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


def iter_hf_params(
    model_dir: str | os.PathLike,
    config: ModelConfig,
    dtype: np.dtype,
    progress: bool = False,
    prequantized: str | None = None,
    group_format: GroupFormat | None = None,
    layers: frozenset[int] | None = None,
) -> Iterator[tuple[Path, np.ndarray]]:
    """Checks an HF safetensors checkpoint from its headers, then reads it one tensor at a time.

    Args:
      model_dir: directory with `model.safetensors` or `model.safetensors.index.json` + shards.
      config: the model configuration (from the same directory's config.json).
      dtype: target numpy dtype of every plain parameter.
      progress: show a tqdm bar over tensors.
      prequantized: the method the checkpoint is already quantized with
        (`checkpoint_quantization` of its config.json; None: plain weights). Its quantized
        weights and their scales keep float8_e4m3fn and float32 whatever `dtype` (see `hf_keys`).
      group_format: the 4/8-bit integer format the projections are stored in
        (`checkpoint_group_format`; `config` must hold its weight groups): each projection's
        tensors are checked by the format's reader (`jaxpaged.checkpoint.formats`) and come,
        after the plain tensors, as its group-quantized triple (`group_state.group_tensors`).
      layers: the decoder layers to read (a pipeline stage's: `TensorParallel.local_layers`);
        None: all. The others' tensors are checked from the headers but not read.

    Returns:
      An iterator of `(params path, layer, array in our layout)`; `layer` is the tensor's row
      of a stacked parameter (None for the others); each array is read when reached (a
      per-expert parameter's layer once all its experts are: `stack_experts`).

    Raises:
      ValueError: missing, unexpected, duplicate, wrongly shaped or wrongly typed tensors, each
        named (before any data is read); a `group_format` of weights jaxpaged-convert quantized
        (its config.json beside safetensors).
    """
    if group_format is not None and group_format.method not in GROUP_FORMATS:
        raise ValueError(
            f"{os.fspath(model_dir)!r}: config.json's quantization_config says jaxpaged-convert quantized the weights "
            f"({group_format.method}), but the directory holds no {FORMAT_FILE}; give the directory jaxpaged-convert "
            "wrote, or restore the Hugging Face config.json"
        )
    ckpt = SafetensorsCheckpoint(model_dir)
    if group_format is None:
        specs, optional = hf_key_specs(config, prequantized), optional_hf_keys(config, prequantized)
        grouped, read_linear = [], None
    else:  # the projections as the format stores them (checked from headers), the rest plain
        linears = quantized_linears(config)
        grouped, read_linear = linear_reader(group_format, linears, ckpt, config.weight_group_size)
        quantized = {prefix + ".weight" for prefix, _, _ in linears}
        specs = [s for s in hf_key_specs(config) if s.hf_name not in quantized]
        optional = optional_hf_keys(config)
    try:
        expected = {s.hf_name for s in specs} | set(grouped)
        skipped = {n for n in ckpt.names if n.startswith(ARCHITECTURES[config.architecture].ignored_prefixes)}
        check_names(expected, set(ckpt.names), f"checkpoint {os.fspath(model_dir)!r}", set(optional) | skipped)
    except ValueError as err:
        if prequantized is None and any(name.endswith(".weight_scale") for name in ckpt.names):
            raise ValueError(
                f"{err} (weight_scale tensors: the weights are quantized, but config.json has no "
                "quantization_config saying how)"
            ) from None
        raise
    for spec in specs:  # from headers, before reading any data
        spec.check(ckpt.shape(spec.hf_name), ckpt.dtype(spec.hf_name))
    for name, shapes in optional.items():
        if shapes is not None and name in ckpt.locations:
            check_shape(name, shapes[0], ckpt.shape(name), also=shapes[1:])
    wanted = by_name([s for s in specs if layers is None or s.layer is None or s.layer in layers])

    def tensors():
        with tqdm(total=len(wanted), desc="loading tensors", unit="tensor", disable=not progress) as bar:
            for name, array in ckpt.iter_tensors(wanted):
                for spec in wanted[name]:  # a fused tensor's parts, each cut out of it
                    yield spec, spec.transform(array, dtype)
                bar.update()

    def read():
        yield from stack_experts(tensors(), 0 if config.moe is None else config.moe.num_experts)
        if read_linear is not None:
            yield from group_tensors(config, read_linear, layers)
        logger.info(
            "read %.2f GiB (%d bytes) of tensors from %s (decoder layers %s of %d)",
            ckpt.bytes_read / 2**30,
            ckpt.bytes_read,
            ckpt.model_dir,
            "all" if layers is None else _spans(layers),
            config.num_layers,
        )

    return read()


def _spans(layers) -> str:
    """Layer numbers as ranges: {0, 1, 2, 5} -> "0-2,5"."""
    spans: list[list[int]] = []
    for n in sorted(layers):
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"


def read_hf_params(
    model_dir: str | os.PathLike,
    config: ModelConfig,
    dtype: np.dtype,
    progress: bool = False,
    prequantized: str | None = None,
    group_format: GroupFormat | None = None,
    quantization: str | None = None,
) -> Params:
    """The whole checkpoint as a nested params dict in our layout, decoder layers stacked (see
    `iter_hf_params`); with `quantization` (of a plain checkpoint; `config` holds its weight
    groups), each quantizable weight is quantized as it is read (`_quantize_tensors`, the same
    arrays `load_model` makes)."""
    shapes = param_shapes(config, prequantized or quantization)
    stacked: dict[Path, np.ndarray] = {}
    params: Params = {}
    tensors = iter_hf_params(model_dir, config, dtype, progress, prequantized, group_format)
    for path, layer, array in _quantize_tensors(tensors, config, quantization, None):
        if layer is None:
            _insert(params, path, array)
            continue
        if path not in stacked:
            stacked[path] = np.empty(shapes[path], array.dtype)
            _insert(params, path, stacked[path])
        stacked[path][layer] = array
    return params


def _checkpoint_tensors(
    model_dir: str | os.PathLike,
    config: ModelConfig,
    stored: StoredWeights,
    dtype: Any,
    parallel: TensorParallel | None = None,
) -> tuple[np.dtype, Iterator]:
    """`(target dtype, iterator of (path, layer, array))` of an HF or a converted directory of
    `config` whose weights are `stored` so (arrays are numpy, or already placed `jax.Array`s when
    Orbax restored them into shards; `layer` is the row of a stacked parameter a tensor fills,
    None: the whole of it). A pre-quantized checkpoint's tensors come as their quantized pairs."""
    if is_converted_dir(model_dir):
        target, params = _load_converted(model_dir, config, dtype, parallel, stored.quantization)
        return target, ((path, None, array) for path, array in _flatten(params).items())
    target = resolve_dtype(dtype, stored.dtype)
    layers = None if parallel is None else parallel.local_layers  # a pipeline stage's: the others are not read
    return target, iter_hf_params(
        model_dir, config, target, prequantized=stored.quantization, group_format=stored.group_format, layers=layers
    )


def load_params(model_dir: str | os.PathLike, dtype: Any = "auto") -> tuple[ModelConfig, Params]:
    """Loads the parameters of an HF directory or a converted directory as numpy arrays.

    Args:
      model_dir: an HF directory (config.json + safetensors) or one written by jaxpaged-convert.
      dtype: "auto" (the checkpoint's dtype; float32 when config.json names none), "float32",
        "bfloat16", "float16" or an equivalent numpy/jnp dtype.

    Returns:
      `(config, params)`: params is a nested dict (layer indices are int keys) matching
      `nnx.state(Llama(config)).to_pure_dict()` (of `Llama(config, quantization="fp8")` for a
      pre-quantized checkpoint: its fp8 weights and float32 scales are not cast to `dtype`).

    Raises:
      FileNotFoundError: no config.json or no checkpoint files.
      ValueError: unsupported config, dtype or `quantization_config`; missing, unexpected,
        duplicate, misshaped or wrongly typed keys.
    """
    config, raw = read_hf_config(model_dir)
    stored = stored_weights(raw)
    config = with_quantized_weights(config, stored.quantization, DEFAULT_GROUP_SIZE, raw)
    if not is_converted_dir(model_dir):
        target = resolve_dtype(dtype, stored.dtype)
        params = read_hf_params(
            model_dir, config, target, prequantized=stored.quantization, group_format=stored.group_format
        )
        return config, params
    _, tensors = _checkpoint_tensors(model_dir, config, stored, dtype)
    params: Params = {}
    for path, _, array in tensors:
        _insert(params, path, array)
    return config, params


def load_model(
    model_dir: str | os.PathLike,
    dtype: Any = "auto",
    attention: str = "auto",
    parallel: TensorParallel | None = None,
    scan_layers: bool = defaults.SCAN_LAYERS,
    quantization: str | None = None,
    quantization_group_size: int = DEFAULT_GROUP_SIZE,
) -> tuple[ModelConfig, Llama]:
    """Loads a checkpoint into an NNX `Llama` without random-initialising it first.

    Each tensor goes straight to its devices as it is read (split by the sharding table under
    tensor parallelism), so host memory holds about one tensor of a safetensors checkpoint.

    Args:
      model_dir: an HF directory or a converted directory (see `load_params`).
      dtype: as in `load_params`; also the model's dtype.
      attention: attention backend, "auto", "reference" or "pallas".
      parallel: the mesh and sharding table; None puts everything on the default device.
      scan_layers: see `Llama`.
      quantization: "fp8", "int8" or "int4": quantize the decoder layers' weights as they are
        read (see `jaxpaged.model.quant`, `jaxpaged.model.group_quant`); None keeps them in
        `dtype`. A pre-quantized checkpoint is read as it is stored (its method, e.g. "fp8",
        whether this is None or the same).
      quantization_group_size: input features per group of "int4".

    Returns:
      `(config, model)`: the checkpoint's config (with its weight groups, `weight_bits` and
      `weight_group_size`, when group-quantized), and the model (in the mesh layout: kv heads
      repeated, experts in their slots, where `parallel` reshapes them).

    Raises:
      ValueError: as `load_params`; `quantization` differs from a pre-quantized checkpoint's; the
        group size does not divide a projection's inputs; `parallel` was laid out for other
        weight groups than these.
    """
    config, raw = read_hf_config(model_dir)
    quantization = resolve_quantization(quantization, raw)
    config = with_quantized_weights(config, quantization, quantization_group_size, raw)
    stored = stored_weights(raw)
    return config, load_checkpoint(model_dir, config, stored, dtype, attention, parallel, scan_layers, quantization)


def load_checkpoint(
    model_dir: str | os.PathLike,
    config: ModelConfig,
    stored: StoredWeights,
    dtype: Any = "auto",
    attention: str = "auto",
    parallel: TensorParallel | None = None,
    scan_layers: bool = defaults.SCAN_LAYERS,
    quantization: str | None = None,
) -> Llama:
    """`load_model` of a checkpoint whose configuration is already read and resolved (the
    engine's: `EngineConfig.model` and `LoadConfig.checkpoint`, read once at start-up).

    Args:
      model_dir: an HF directory or a converted directory.
      config: its configuration, with the weight groups of `quantization`
        (`with_quantized_weights`).
      stored: how it stores its weights (`stored_weights` of its config.json).
      dtype, attention, parallel, scan_layers: as in `load_model`.
      quantization: the weights' method, resolved against the checkpoint's
        (`resolve_quantization`), or None.

    Raises:
      ValueError: as `load_model`.
    """
    if parallel is not None and parallel.layout.config.weight_group_size != config.weight_group_size:
        raise ValueError(
            f"the tensor-parallel layout is for weight_group_size={parallel.layout.config.weight_group_size}, the "
            f"weights are quantized in groups of {config.weight_group_size}: lay it out from the config "
            "with_weight_groups gives"
        )
    quantize_at_load = None if stored.quantization else quantization  # pre-quantized: stored so
    target, tensors = _checkpoint_tensors(model_dir, config, stored, dtype, parallel)
    model_config = parallel.layout.mesh_config if parallel is not None else config
    abstract = nnx.eval_shape(
        lambda: Llama(
            model_config,
            target,
            rngs=nnx.Rngs(0),
            attention=attention,
            parallel=parallel,
            scan_layers=scan_layers,
            quantization=quantization,
        )
    )
    graphdef, state = nnx.split(abstract)
    shapes = param_shapes(model_config, quantization)
    params: Params = {}
    stacked: dict[Path, jax.Array] = {}  # scanned layers: each layer's tensor set into its row
    layers: dict[Path, list] = {}  # unrolled layers: each layer's tensor an array of its own
    for path, layer, array in _quantize_tensors(tensors, config, quantize_at_load, parallel):
        if layer is not None:  # one layer's tensor of a per-layer parameter, placed on its devices
            row = jax.device_put(array) if parallel is None else parallel.place_layer(path, array, layer)
            if not scan_layers:
                layers.setdefault(path, [None] * model_config.num_layers)[layer] = row
            else:  # set in place into the stacked parameter
                if path not in stacked:
                    stacked[path] = _zeros_on_mesh(shapes[path], array.dtype, parallel, path)
                stacked[path] = _set_row(stacked[path], row, jnp.int32(layer))
        elif isinstance(array, jax.Array):  # restored into its shards
            _insert(params, path, array)
        else:
            _insert(params, path, jax.device_put(array) if parallel is None else parallel.place(path, array))
        del array
    for path, array in stacked.items():
        _insert(params, path, array)
    for path, arrays in layers.items():  # under pipeline parallelism: the stages' layer slots
        _insert(params, path, LayerArrays(arrays if parallel is None else parallel.stack_stages(path, arrays)))
    if not scan_layers and parallel is not None and parallel.layout.pipeline.size > 1:
        params = _stage_restored_layers(params, parallel)
    elif not scan_layers:  # a converted checkpoint is restored stacked: split once, each stacked array freed
        params = unstack_layers(params, _layer_sharding(parallel), release=True)
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    leftover = [leaf for leaf in jax.tree.leaves(nnx.state(model)) if not isinstance(leaf, jax.Array)]
    if leftover:
        raise RuntimeError(f"{len(leftover)} model variables were not filled from the checkpoint")
    return model


def _quantize_tensors(
    tensors: Iterator, config: ModelConfig, quantization: str | None, parallel: TensorParallel | None
) -> Iterator:
    """The checkpoint's `(path, layer, array)` with every quantizable weight replaced by its
    quantized pair or group-quantized triple (`quantize_param`). A numpy tensor is quantized on the default device and
    comes back as numpy; one Orbax restored into its shards is quantized where it lies, into
    the shards of its pair (nothing gathered, so also across processes)."""
    for path, layer, array in tensors:
        spec = None if quantization is None else quantizable(config, path)
        if spec is None:
            yield path, layer, array
            continue
        paths = quantized_paths(config, spec)
        num_lead = (1 if layer is None and spec.per_layer else 0) + spec.num_lead  # stacked layers, experts
        quantize = functools.partial(
            quantize_param, method=quantization, config=config, num_in=spec.num_in, num_lead=num_lead
        )
        if isinstance(array, jax.Array) and parallel is not None and layer is None:
            shardings = tuple(parallel.restore_sharding(path) for path in paths)  # where it was restored
            arrays = jax.jit(quantize, out_shardings=shardings)(array)
        else:
            arrays = [np.asarray(x) for x in quantize(jnp.asarray(array))]
        del array
        for path, quantized in zip(paths, arrays):
            yield path, layer, quantized


def _load_converted(
    model_dir: str | os.PathLike,
    config: ModelConfig,
    dtype: Any,
    parallel: TensorParallel | None = None,
    prequantized: str | None = None,
) -> tuple[np.dtype, Params]:
    """Restores a converted checkpoint: as numpy arrays, or with `parallel` straight into each
    tensor's shards (each device reads its part; tensors the mesh reshapes, kv heads repeated
    or experts in their slots, come back as numpy for `parallel.place`). Plain tensors are cast to `dtype`; the quantized pairs
    of a pre-quantized checkpoint are checked to be stored as they must be and kept so (4-bit
    codes, stored int4, come as the platform holds them: `code_dtype`)."""
    import orbax.checkpoint as ocp  # only converted checkpoints need Orbax

    with open(os.path.join(model_dir, FORMAT_FILE)) as f:
        marker = json.load(f)
    if marker.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{FORMAT_FILE} in {os.fspath(model_dir)!r} has format_version={marker.get('format_version')!r}; "
            f"this jaxpaged reads version {FORMAT_VERSION}: re-run jaxpaged-convert"
        )
    if marker.get("quantization") != prequantized:  # markers before quantization hold none
        raise ValueError(
            f"{FORMAT_FILE} in {os.fspath(model_dir)!r} says quantization={marker.get('quantization')!r} but its "
            f"config.json says {prequantized!r} (quantization_config); keep the config.json jaxpaged-convert copied"
        )
    target = resolve_dtype(dtype, marker.get("dtype"))
    params_dir = os.path.abspath(os.path.join(model_dir, PARAMS_DIR))
    if not os.path.isdir(params_dir):
        raise FileNotFoundError(f"converted checkpoint {os.fspath(model_dir)!r} has no {PARAMS_DIR}/ directory")
    expected = param_shapes(config, prequantized)
    with ocp.PyTreeCheckpointer() as checkpointer:
        # Names, shapes and dtypes from the metadata first; then read as numpy, cast while reading.
        meta = checkpointer.metadata(params_dir)
        meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
        stored = {path: tuple(m.shape) for path, m in _flatten(meta).items()}
        check_names(set(expected), set(stored), f"converted checkpoint {params_dir!r}")
        for path, m in _flatten(meta).items():
            check_shape(_dotted(path), expected[path], tuple(m.shape))
            kept = kept_dtype(config, path, prequantized)
            if kept is not None and np.dtype(m.dtype) != kept:
                raise ValueError(
                    f"tensor {_dotted(path)!r} in {params_dir!r} is stored as {np.dtype(m.dtype)}, "
                    f"expected {kept} (the checkpoint is {prequantized}-quantized)"
                )

        def restore_args(path, _):
            path = param_path(path)
            cast = target if kept_dtype(config, path, prequantized) is None else None  # quantized pairs as stored
            if config.weight_group_size is not None and find_state_param(config, path).role == "quant":
                cast = code_dtype(config.weight_bits)  # int4 on disk, int8 on a CPU
            if parallel is None or parallel.reshapes(path):
                return ocp.RestoreArgs(restore_type=np.ndarray, dtype=cast)
            return ocp.ArrayRestoreArgs(sharding=parallel.restore_sharding(path), dtype=cast)

        args = jax.tree_util.tree_map_with_path(restore_args, meta)
        restored = checkpointer.restore(params_dir, restore_args=args)
    params: Params = {}
    for path, array in _flatten(restored).items():
        _insert(params, path, array if isinstance(array, jax.Array) else np.asarray(array))
    return target, params


def _stage_restored_layers(params: Params, parallel: TensorParallel) -> Params:
    """A converted checkpoint's stacked layer parameters (restored `[L, ...]` in
    `restore_sharding`) as the stages' layer slots (pipeline parallelism), cut on the devices
    (`slots_of_stack`), each stacked array freed once cut. A tensor restored to the host (its
    kv heads repeated onto more devices) goes layer by layer to its stage (`place_layer`)."""

    def split(path, x):
        path = param_path(path)
        if not path or path[0] != LAYER_STACK or isinstance(x, LayerArrays):
            return x
        if isinstance(x, np.ndarray):
            rows = [parallel.place_layer(path, x[layer], layer) for layer in range(x.shape[0])]
            return LayerArrays(parallel.stack_stages(path, rows))
        slots = parallel.slots_of_stack(path, x)
        x.delete()
        return LayerArrays(slots)

    return jax.tree_util.tree_map_with_path(split, params, is_leaf=lambda x: isinstance(x, LayerArrays))


def _layer_sharding(parallel: TensorParallel | None):
    """Where one layer's array of the parameter at a path lives."""
    if parallel is None:
        return lambda path: jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return parallel.layer_sharding


def _zeros_on_mesh(shape: tuple[int, ...], dtype, parallel: TensorParallel | None, path: Path) -> jax.Array:
    """Zeros of a stacked parameter made where they live (each device its shard)."""
    sharding = None if parallel is None else parallel.param_sharding(path)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


@functools.partial(jax.jit, donate_argnums=(0,))
def _set_row(stacked: jax.Array, row: jax.Array, index: jax.Array) -> jax.Array:
    """`stacked[index] = row` in place (the stacked buffer is donated)."""
    return jax.lax.dynamic_update_index_in_dim(stacked, row.astype(stacked.dtype), index, 0)


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
