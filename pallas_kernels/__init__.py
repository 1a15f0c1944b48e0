"""Paged-attention kernels for NVIDIA GPUs, each beside a pure-jnp reference (`reference`).

Public kernels (same signatures as their references):
  write_kv                 scatter this step's K/V into the paged pools (XLA, in place)
  paged_decode_attention   one query token per sequence (Pallas Triton, flash-decoding)
  ragged_paged_attention   any mix of decodes, prefills and chunks (Pallas Triton)
"""

from pallas_kernels.decode_attention import paged_decode_attention
from pallas_kernels.ragged_attention import ragged_paged_attention
from pallas_kernels.write_kv import write_kv

__all__ = ["paged_decode_attention", "ragged_paged_attention", "write_kv"]
