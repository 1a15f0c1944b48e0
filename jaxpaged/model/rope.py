"""Rotary position embeddings (default, linear, llama3 and LongRoPE scaling; partial rotation),
as transformers computes them."""

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxpaged.config.model_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """float32 `[R // 2]` inverse frequencies after the configured scaling (R: the rotated
    features, `rope.rotary_dim(head_dim)`)."""
    dim = rope.rotary_dim(head_dim)
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / dim
    if rope.rope_type == "longrope":  # each frequency divided by its factor, short or long
        factors = np.asarray(rope.long_factor if rope.use_long_factor else rope.short_factor, np.float32)
        return (1.0 / (factors * rope.theta**exponents)).astype(np.float32)
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
    x: Float[Array, "T N H"], positions: Int[Array, " T"], inv_freq: Float[Array, " R2"], scale: float = 1.0
) -> Float[Array, "T N H"]:
    """Rotates the halves of each head's first R features (R = 2 x inv_freq's length; the rest
    pass through) by `positions * inv_freq`, HF's rotate_half convention, cos and sin
    multiplied by `scale` (`RopeConfig.attention_factor`)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, R/2]
    cos = (jnp.cos(angles) * scale).astype(x.dtype)[:, None, :]
    sin = (jnp.sin(angles) * scale).astype(x.dtype)[:, None, :]
    rotary = 2 * inv_freq.shape[0]
    x1, x2 = jnp.split(x[..., :rotary], 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary:]], axis=-1)
