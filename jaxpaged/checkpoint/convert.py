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

A pre-quantized checkpoint (compressed-tensors FP8, detected from config.json's
`quantization_config`) stays quantized: its weights are written as the loader reads them,
`<name>_quant` in float8_e4m3fn (Orbax stores the type natively, bytes unchanged) and
`<name>_scale` in float32, and `dtype` applies only to the plain tensors (embedding, norms, LM
head). config.json keeps its `quantization_config`, so the converted directory loads as fp8
again; the marker's `quantization` ("fp8", or null) records it. Quantizing a plain checkpoint
while converting is not offered: the engine quantizes plain weights at load (`--quantization`).
"""

import glob
import importlib.metadata
import json
import os
import shutil
from typing import Any

import orbax.checkpoint as ocp

from jaxpaged.checkpoint.format import FORMAT_FILE, FORMAT_VERSION, PARAMS_DIR
from jaxpaged.checkpoint.loader import (
    Params,
    dtype_name,
    is_converted_dir,
    read_hf_config,
    read_hf_params,
    resolve_dtype,
)
from jaxpaged.config.quantization import checkpoint_group_format, checkpoint_quantization

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

    Returns:
      `out_dir` as a string.

    Raises:
      FileNotFoundError: `hf_dir` lacks config.json or safetensors.
      FileExistsError: `out_dir` already holds a checkpoint and `overwrite` is False.
      ValueError: unsupported config, dtype or `quantization_config`; missing, unexpected,
        duplicate, misshaped or wrongly typed keys.
    """
    hf_dir, out_dir = os.fspath(hf_dir), os.fspath(out_dir)
    if is_converted_dir(hf_dir):
        raise ValueError(f"--hf-dir {hf_dir!r} is already a jaxpaged-converted directory; pass the HF directory")
    config, raw = read_hf_config(hf_dir)
    if os.path.exists(out_dir) and os.path.samefile(hf_dir, out_dir):
        raise ValueError(f"--out {out_dir!r} is the HF directory itself; pass a different output directory")
    target = resolve_dtype(dtype, raw.get("dtype") or raw.get("torch_dtype"))
    prequantized = checkpoint_quantization(raw)
    if checkpoint_group_format(raw) is not None:
        raise ValueError(
            f"--hf-dir {hf_dir!r} is a {prequantized} checkpoint (config.json's quantization_config): "
            "jaxpaged-convert writes plain and FP8 checkpoints only; serve the Hugging Face directory itself, "
            "which is read with its weights kept 4/8-bit"
        )
    _prepare_out_dir(out_dir, overwrite)

    params = read_hf_params(hf_dir, config, target, progress=progress, prequantized=prequantized)
    num_params = _save_params(os.path.join(out_dir, PARAMS_DIR), params)
    del params

    for name in CONFIG_FILES + TOKENIZER_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copy2(os.path.join(hf_dir, name), os.path.join(out_dir, name))
    for pattern in TOKENIZER_GLOBS:
        for path in glob.glob(os.path.join(glob.escape(hf_dir), pattern)):
            shutil.copy2(path, os.path.join(out_dir, os.path.basename(path)))
    marker = {
        "format": "jaxpaged",
        "format_version": FORMAT_VERSION,
        "dtype": dtype_name(target),
        "quantization": prequantized,
        "source": os.path.abspath(hf_dir),
        "architecture": config.architecture,
        "num_params": num_params,
        "jaxpaged_version": _version(),
    }
    with open(os.path.join(out_dir, FORMAT_FILE), "w") as f:
        json.dump(marker, f, indent=2)
        f.write("\n")
    return out_dir


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
