"""The KV cache scales a pre-quantized checkpoint may carry (compressed-tensors `kv_cache_scheme`):
one number per layer for K and one for V, `self_attn.k_scale` / `v_scale` (older files:
`k_proj.output_scale` / `v_proj.output_scale`). An fp8 KV cache stores `x / scale`, as vLLM does
with them; without them its scales are 1. No JAX here.
"""

import os

import numpy as np

from jaxpaged.checkpoint.format import SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE
from jaxpaged.checkpoint.safetensors_index import SafetensorsCheckpoint

_NAMES = {
    "k": ("self_attn.k_scale", "self_attn.k_proj.output_scale"),
    "v": ("self_attn.v_scale", "self_attn.v_proj.output_scale"),
}


def checkpoint_kv_scales(model_dir: str | os.PathLike, num_layers: int) -> tuple[np.ndarray, np.ndarray] | None:
    """`(k_scale [L], v_scale [L])` float32 from a safetensors checkpoint that has them for every
    layer, else None (none there, or not a safetensors directory).

    Raises:
      ValueError: scales for some layers but not all, or a scale that is not a positive number.
    """
    if not any(os.path.isfile(os.path.join(model_dir, f)) for f in (SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE)):
        return None
    ckpt = SafetensorsCheckpoint(model_dir)
    present = set(ckpt.names)
    wanted: dict[str, tuple[str, int]] = {}
    for kind, suffixes in _NAMES.items():
        for layer in range(num_layers):
            names = [f"model.layers.{layer}.{s}" for s in suffixes if f"model.layers.{layer}.{s}" in present]
            if names:
                wanted[names[0]] = (kind, layer)
    if not wanted:
        return None
    if len(wanted) != 2 * num_layers:
        raise ValueError(
            f"checkpoint {os.fspath(model_dir)!r} has KV cache scales for {len(wanted)} of the "
            f"{2 * num_layers} K and V layers; it needs all or none"
        )
    scales = {"k": np.zeros(num_layers, np.float32), "v": np.zeros(num_layers, np.float32)}
    for name, array in ckpt.iter_tensors(wanted):
        value = np.asarray(array, np.float32).reshape(-1)
        kind, layer = wanted[name]
        if value.size != 1 or not np.isfinite(value[0]) or value[0] <= 0:
            raise ValueError(f"tensor {name!r} must be one positive number, got {value.tolist()[:4]}")
        scales[kind][layer] = value[0]
    return scales["k"], scales["v"]
