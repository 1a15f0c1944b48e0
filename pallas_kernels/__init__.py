"""Pallas kernels for NVIDIA GPUs, each beside a pure-jnp or XLA reference: the attention kernels'
in `reference` (same signatures), the group-quantized matmul's `jaxpaged.model.group_quant.group_matmul`.

Public kernels (the attention kernels read float8 pools with per-kv-head k_scale / v_scale,
dequantising inside the kernel):
  write_kv                 scatter this step's K/V into the paged pools (XLA, in place), optionally
                           quantised to float8 with per-kv-head scales
  paged_decode_attention   one query token per sequence (Pallas Triton, flash-decoding)
  ragged_paged_attention   any mix of decodes, prefills and chunks (Pallas Triton)
  grouped_matmul           rows sorted by expert, each tile times its expert's weight (Pallas
                           Triton; a mixture of experts' FFN), `grouped_matmul_supports` its widths
  group_quant_matmul       activations times a group-quantized 4/8-bit weight, dequantized in
                           registers (Pallas Triton)

`compiling_for("gpu")` makes traces inside it compile the kernels for a GPU on any machine
(lowering, or deviceless compilation); `target_platform()` is the platform traces are for.
"""

from pallas_kernels.decode_attention import paged_decode_attention
from pallas_kernels.grouped_matmul import grouped_matmul
from pallas_kernels.grouped_matmul import supports as grouped_matmul_supports
from pallas_kernels.platform import compiling_for, target_platform
from pallas_kernels.quant_matmul import group_quant_matmul
from pallas_kernels.ragged_attention import ragged_paged_attention
from pallas_kernels.reference import NO_WINDOW
from pallas_kernels.write_kv import write_kv

__all__ = [
    "NO_WINDOW",
    "compiling_for",
    "grouped_matmul",
    "grouped_matmul_supports",
    "group_quant_matmul",
    "paged_decode_attention",
    "target_platform",
    "ragged_paged_attention",
    "write_kv",
]
