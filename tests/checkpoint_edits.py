"""Copying and editing saved checkpoints in tests (broken files built from good ones)."""

import importlib
import json
import os
import shutil

from safetensors.torch import save_file


def copy_checkpoint(src, dst):
    """A copy of the model directory `src` at `dst`; returns `dst`."""
    shutil.copytree(src, dst)
    return dst


def edit_tensors(model_dir, edit, framework: str = "numpy"):
    """Rewrites `model_dir/model.safetensors` with `edit(dict of tensors)` applied; the tensors
    are numpy arrays, or torch tensors with `framework="torch"` (float8 needs torch)."""
    library = importlib.import_module(f"safetensors.{framework}")
    path = os.path.join(model_dir, "model.safetensors")
    tensors = library.load_file(path)
    edit(tensors)
    library.save_file(tensors, path, metadata={"format": "pt"})


def save_quantized_checkpoint(model, tensors: dict, out_dir: str, quantization_config: dict) -> None:
    """Saves `tensors` (torch) as `out_dir/model.safetensors` beside `model`'s config.json, which
    gets `quantization_config`."""
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out_dir)
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
