"""Copying and editing saved checkpoints in tests (broken files built from good ones)."""

import importlib
import os
import shutil


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
