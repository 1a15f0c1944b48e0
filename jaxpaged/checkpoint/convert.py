"""Convert a Hugging Face safetensors checkpoint to the jaxpaged on-disk format.

Output directory layout:

```
out_dir/
  params/                  Orbax (StandardCheckpointer) checkpoint of the nested params dict,
                           our einsum-ready layout, layer indices stored as "0", "1", ...
  config.json              copied from the HF directory (the loader reads the config from it)
  generation_config.json   copied when present
  tokenizer files          every one present (tokenizer.json, tokenizer_config.json, ...)
  jaxpaged_format.json     {"format": "jaxpaged", "format_version", "dtype", "quantization",
                           "source", ...}; written last, so a half-written directory is never loaded
```

A pre-quantized checkpoint (detected from config.json's `quantization_config`) stays quantized:
its weights are written as the loader reads them, and `dtype` applies only to the plain tensors
(embedding, norms, LM head):

- compressed-tensors FP8: `<name>_quant` in float8_e4m3fn (Orbax stores the type natively, bytes
  unchanged) and `<name>_scale` in float32;
- AWQ, GPTQ, compressed-tensors pack-quantized (4/8-bit integers): the model state's group-quantized
  arrays (`jaxpaged.model.group_quant`): `<name>_quant` codes in int4 (4 bits; Orbax's int4, a
  nibble of data each) or int8, `<name>_scale` float32, `<name>_zero` int8, and for act order
  (GPTQ `desc_act`) `<name>_perm` int32, inputs already sorted by group.

config.json keeps its `quantization_config`, so the converted directory loads with the same
method, bits and groups again. A plain checkpoint may be quantized while converting with
`quantization="int4"` (round to nearest in groups of `quantization_group_size`, the arrays
`--quantization int4` makes at load); its config.json then records the method, bits and group size
(`jaxpaged.config.quantization.converted_quantization_config`), so loading it needs no flag and a
different group size or method asked at load is refused. The marker's `quantization` (the method,
or null) records it too; fp8 and int8 are quantized at load only (`--quantization`).
"""

import glob
import importlib.metadata
import json
import os
import shutil
from typing import Any

import orbax.checkpoint as ocp

from jaxpaged.checkpoint.format import FORMAT_FILE, FORMAT_VERSION, PARAMS_DIR
from jaxpaged.checkpoint.hf_keys import kept_dtype
from jaxpaged.checkpoint.loader import (
    Params,
    dtype_name,
    is_converted_dir,
    read_hf_config,
    read_hf_params,
    resolve_dtype,
)
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.quantized import with_quantized_weights
from jaxpaged.config.quantization import (
    DEFAULT_GROUP_SIZE,
    GROUP_QUANT_BITS,
    checkpoint_group_format,
    checkpoint_quantization,
    converted_quantization_config,
)

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.json",
)
TOKENIZER_GLOBS = ("*.jinja", "*.tiktoken")


def convert_checkpoint(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: Any = "bfloat16",
    overwrite: bool = False,
    progress: bool = True,
    quantization: str | None = None,
    quantization_group_size: int = DEFAULT_GROUP_SIZE,
) -> str:
    """Converts an HF checkpoint directory into a jaxpaged directory (see the module docstring).

    Args:
      hf_dir: Hugging Face model directory (config.json + safetensors, tokenizer files).
      out_dir: output directory; created if needed. It must not already hold a checkpoint.
      dtype: parameter dtype on disk: "bfloat16", "float32", "float16" or "auto" (the
        checkpoint's own dtype); a pre-quantized checkpoint's quantized weights and scales
        keep theirs (float8_e4m3fn, float32).
      overwrite: replace a checkpoint already in `out_dir`.
      progress: show a tqdm bar over tensors.
      quantization: "int4": quantize a plain checkpoint's decoder projections while converting
        (see the module docstring); None: keep the weights as the checkpoint stores them.
      quantization_group_size: input features per group of "int4" (must divide every
        projection's inputs).

    Returns:
      `out_dir` as a string.

    Raises:
      FileNotFoundError: `hf_dir` lacks config.json or safetensors.
      FileExistsError: `out_dir` already holds a checkpoint and `overwrite` is False.
      ValueError: unsupported config, dtype or `quantization_config`; missing, unexpected,
        duplicate, misshaped or wrongly typed keys; a `quantization` other than "int4", or of a
        pre-quantized checkpoint; a group size without it, or not dividing a projection's inputs.
    """
    hf_dir, out_dir = os.fspath(hf_dir), os.fspath(out_dir)
    if is_converted_dir(hf_dir):
        raise ValueError(f"--hf-dir {hf_dir!r} is already a jaxpaged-converted directory; pass the HF directory")
    config, raw = read_hf_config(hf_dir)
    if os.path.exists(out_dir) and os.path.samefile(hf_dir, out_dir):
        raise ValueError(f"--out {out_dir!r} is the HF directory itself; pass a different output directory")
    target = resolve_dtype(dtype, raw.get("dtype") or raw.get("torch_dtype"))
    prequantized = checkpoint_quantization(raw)
    _check_quantization(quantization, quantization_group_size, prequantized)
    method = prequantized or quantization
    config = with_quantized_weights(config, method, quantization_group_size, raw)
    _prepare_out_dir(out_dir, overwrite)

    params = read_hf_params(
        hf_dir, config, target, progress, prequantized, checkpoint_group_format(raw), quantization=quantization
    )
    num_params = _save_params(os.path.join(out_dir, PARAMS_DIR), _as_stored(params, config, method))
    del params

    for name in CONFIG_FILES + TOKENIZER_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copy2(os.path.join(hf_dir, name), os.path.join(out_dir, name))
    if quantization is not None:  # config.json says how its weights were quantized
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(
                {**raw, "quantization_config": converted_quantization_config(quantization, config.weight_group_size)},
                f,
                indent=2,
            )
            f.write("\n")
    for pattern in TOKENIZER_GLOBS:
        for path in glob.glob(os.path.join(glob.escape(hf_dir), pattern)):
            shutil.copy2(path, os.path.join(out_dir, os.path.basename(path)))
    marker = {
        "format": "jaxpaged",
        "format_version": FORMAT_VERSION,
        "dtype": dtype_name(target),
        "quantization": method,
        "source": os.path.abspath(hf_dir),
        "architecture": config.architecture,
        "num_params": num_params,
        "jaxpaged_version": _version(),
    }
    with open(os.path.join(out_dir, FORMAT_FILE), "w") as f:
        json.dump(marker, f, indent=2)
        f.write("\n")
    return out_dir


def _check_quantization(quantization: str | None, group_size: int, prequantized: str | None) -> None:
    """Refuses a method the converter does not quantize with, quantizing a pre-quantized
    checkpoint again, and a group size without a method that takes it (each naming its flag)."""
    if quantization is not None and quantization not in GROUP_QUANT_BITS:
        raise ValueError(
            f"--quantization {quantization}: jaxpaged-convert quantizes to {', '.join(GROUP_QUANT_BITS)}; fp8 and int8 "
            "are quantized at load (jaxpaged's --quantization), from the plain converted directory"
        )
    if quantization is not None and prequantized is not None:
        raise ValueError(
            f"--quantization {quantization}: the checkpoint is already quantized as {prequantized} (its config.json's "
            "quantization_config), and is converted so without it; drop --quantization"
        )
    if quantization is None and group_size != DEFAULT_GROUP_SIZE:
        raise ValueError(
            f"--quantization-group-size {group_size}: sets the groups of --quantization "
            f"{', '.join(GROUP_QUANT_BITS)}, which is not given (a 4-bit checkpoint's groups are its own)"
        )


def _as_stored(params: Params, config: ModelConfig, method: str | None) -> Params:
    """The params with each quantized array in the dtype the checkpoint stores it in
    (`kept_dtype`: 4-bit codes, held in int8 on a CPU, as int4)."""

    def stored(tree, prefix):
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out[key] = stored(value, prefix + (key,))
                continue
            kept = kept_dtype(config, prefix + (key,), method)
            out[key] = value if kept is None else value.astype(kept, copy=False)
        return out

    return stored(params, ())


def _prepare_out_dir(out_dir: str, overwrite: bool) -> None:
    """Creates `out_dir`; refuses (or, with overwrite, removes) a checkpoint already in it."""
    existing = [n for n in (PARAMS_DIR, FORMAT_FILE) if os.path.exists(os.path.join(out_dir, n))]
    if existing and not overwrite:
        raise FileExistsError(
            f"--out {out_dir!r} already contains a checkpoint ({', '.join(existing)}); "
            "pass --overwrite (overwrite=True) to replace it"
        )
    if existing:
        if FORMAT_FILE in existing:  # first, so an interrupted overwrite is never loadable
            os.remove(os.path.join(out_dir, FORMAT_FILE))
        shutil.rmtree(os.path.join(out_dir, PARAMS_DIR), ignore_errors=True)
        # Stale tokenizer files of an earlier model must not survive next to the new weights.
        for name in CONFIG_FILES + TOKENIZER_FILES:
            if os.path.isfile(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
        for pattern in TOKENIZER_GLOBS:
            for path in glob.glob(os.path.join(glob.escape(out_dir), pattern)):
                os.remove(path)
    os.makedirs(out_dir, exist_ok=True)


def _save_params(path: str, params: Params) -> int:
    """Writes the params with Orbax (layer indices as string keys); returns the element count."""

    def stringify(tree):
        return {str(k): stringify(v) if isinstance(v, dict) else v for k, v in tree.items()}

    tree = stringify(params)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(path), tree)
        checkpointer.wait_until_finished()
    return sum(int(leaf.size) for leaf in _leaves(tree))


def _leaves(tree: dict):
    for value in tree.values():
        yield from _leaves(value) if isinstance(value, dict) else (value,)


def _version() -> str | None:
    try:
        return importlib.metadata.version("jaxpaged")
    except importlib.metadata.PackageNotFoundError:
        return None
