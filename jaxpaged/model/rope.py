"""Rotary position embeddings (default, linear and llama3 scaling), as transformers computes them."""

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxpaged.config.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 `[H // 2]` inverse frequencies after the configured scaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    inv_freq = (1.0 / (rope.theta**exponents)).astype(np.float32)
    if rope.rope_type == "linear":
        return (inv_freq / rope.factor).astype(np.float32)
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope)
    return inv_freq


def _llama3_scaling(inv_freq: np.ndarray, rope: RopeConfig) -> np.ndarray:
    """Llama 3.1 frequency-dependent scaling: long wavelengths divided by `factor`,
    short ones kept, and a smooth blend in between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: Float[Array, "T N H"], positions: Int[Array, " T"], inv_freq: Float[Array, " H2"]
) -> Float[Array, "T N H"]:
    """Rotates each head's halves by `positions * inv_freq` (HF's rotate_half convention)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos = jnp.cos(angles).astype(x.dtype)[:, None, :]
    sin = jnp.sin(angles).astype(x.dtype)[:, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
