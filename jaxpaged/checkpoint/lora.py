"""A LoRA adapter's weights read into the adapter pool's layout (numpy; no JAX here).

PEFT stores, for each adapted module of each layer, `<module>.lora_A.weight` `[r, in]` and
`<module>.lora_B.weight` `[out, r]` (keys prefixed `base_model.model.`). The pool holds, per
projection, A as `[L, *in, R]` and B as `[L, R, *out]` in the model's einsum layout (R: the
engine's `max_lora_rank`): ranks below R are padded with zeros (an exact no-op), PEFT's scaling
is folded into B, a projection the adapter leaves alone is zeros, and under tensor parallelism
with more devices than kv heads the k/v projections' heads are repeated as the mesh holds them.
"""

import dataclasses
import hashlib
import math
import os
import typing

import ml_dtypes
import numpy as np
from safetensors import safe_open

from jaxpaged.checkpoint.safetensors_index import _data_offsets, _read_raw
from jaxpaged.config.lora import WEIGHTS_FILE, lora_targets, module_key, projection_dims, read_adapter_config
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.spec import KV_HEADS

PEFT_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class LoraWeights:
    """One adapter, read and laid out for a pool slot.

    Attributes:
      a: projection name -> `[L, *in, R]` float32 (every projection `lora_targets` names).
      b: projection name -> `[L, R, *out]` float32, PEFT's scaling folded in.
      fingerprint: sha256 of the adapter's files: blocks computed under it are cached under it.
    A trainer's adapter (`LoraRegistry.update`) holds its own `jax.Array`s, of rank r <= R, and
    its registration key as the fingerprint.
    """

    a: dict[str, typing.Any]  # numpy arrays read here, or a trainer's jax.Array
    b: dict[str, typing.Any]
    fingerprint: str


def read_lora_weights(path: str, config: ModelConfig, max_rank: int, kv_replicas: int = 1) -> LoraWeights:
    """Reads the PEFT adapter in directory `path` for a model of `config` (the checkpoint's, not
    the mesh's) into the pool's layout at rank `max_rank`.

    Raises:
      ValueError: its config is refused (`read_adapter_config`), a rank above `max_rank`, a
        tensor of the wrong shape, or adapter tensors of modules this engine does not adapt.
    """
    adapter = read_adapter_config(path, config)
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"{path}: no {WEIGHTS_FILE} there (PEFT's save_pretrained writes one)")
    tensors = _read_all(file)
    specs, dims = lora_targets(config), projection_dims(config)
    a_out, b_out, used = {}, {}, set()
    for name, spec in specs.items():
        ins, outs = dims[name]
        a = np.zeros((config.num_layers, *ins, max_rank), np.float32)
        b = np.zeros((config.num_layers, max_rank, *outs), np.float32)
        if name in adapter.targets:
            for layer in range(config.num_layers):
                module = module_key(spec, layer)
                key_a, key_b = f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"
                if key_a not in tensors or key_b not in tensors:
                    raise ValueError(f"{file}: {module} is adapted (target_modules) but {key_a} or {key_b} is missing")
                lora_a, lora_b = tensors[key_a], tensors[key_b]
                r = lora_a.shape[0]
                if r > max_rank:
                    raise ValueError(
                        f"{path}: {module} has rank {r}, above max_lora_rank={max_rank}; raise --max-lora-rank to {r}"
                    )
                if lora_a.shape != (r, math.prod(ins)) or lora_b.shape != (math.prod(outs), r):
                    raise ValueError(
                        f"{file}: {module}'s lora_A {lora_a.shape} / lora_B {lora_b.shape} do not fit the model's "
                        f"{math.prod(ins)} -> {math.prod(outs)} projection: an adapter of another base model?"
                    )
                a[layer, ..., :r] = lora_a.T.reshape(*ins, r)
                b[layer, :r] = (lora_b.T * adapter.scale_of(module)).reshape(r, *outs)
                used |= {key_a, key_b}
        for axis_index, axis in enumerate(spec.axes[spec.num_in :]):
            if axis == KV_HEADS and kv_replicas > 1:  # the mesh's layout: each kv head repeated in place
                b = np.repeat(b, kv_replicas, axis=2 + axis_index)
        a_out[name], b_out[name] = a, b
    unused = sorted(k for k in tensors if k not in used)
    if unused:
        raise ValueError(f"{file}: tensors of modules this engine does not adapt: {', '.join(unused[:4])}")
    return LoraWeights(a_out, b_out, _fingerprint(path))


def _read_all(file: str) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as float32 (bfloat16 read as raw bytes)."""
    out, offsets = {}, None
    with safe_open(file, framework="np") as f:
        for name in f.keys():
            tensor = f.get_slice(name)
            if tensor.get_dtype() == "BF16":
                offsets = offsets or _data_offsets(file)
                array = _read_raw(file, offsets[name], np.dtype(ml_dtypes.bfloat16), tuple(tensor.get_shape()))
            else:
                array = f.get_tensor(name)
            out[name] = np.asarray(array, np.float32)
    return out


def _fingerprint(path: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            digest.update(name.encode())
            with open(full, "rb") as f:
                digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()
