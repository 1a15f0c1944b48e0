"""Grouped matmul (a mixture of experts' FFN) as a Pallas Triton kernel: rows sorted by expert,
each tile of rows times its expert's weight read where it lies.

Grid (tile t, output block n). The caller's tile schedule says, per tile, its expert, its first
row and how many of its rows are its own (`live`; 0: a spare tile, which does nothing). Program
(t, n) loads the tile's rows (padded to >= 16 for `dot`, the rows past `live` masked), walks the
input width in BK-wide steps multiplying them by `w[expert, k-step, n-block]` in float32, and
stores its live rows of output block n. No expert's weight is copied out of the `[E, I, O]`
array first (XLA's loop over tiles slices each tile's expert weight into a temporary before its
GEMM: 112 MiB at Mixtral's shapes), and a spare tile reads nothing.

Dimension letters: M rows, I input width, O output width, E experts, NT tiles, TM rows per tile.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import _common as c

_BLOCK_N = 128
_BLOCK_K = 64
_NUM_WARPS = 4
_NUM_STAGES = 2


def supports(in_width: int, out_width: int) -> bool:
    """Whether the kernel takes these widths: whole BK input steps and BN output blocks."""
    return in_width % _BLOCK_K == 0 and out_width % _BLOCK_N == 0


def _kernel(expert_ref, first_ref, live_ref, x_ref, w_ref, o_ref, *, rows: int, num_k: int):
    t, n = c.pl.program_id(0), c.pl.program_id(1)
    live = live_ref[t]

    @c.pl.when(live > 0)
    def _():
        expert, first = expert_ref[t], first_ref[t]
        row = first + jnp.arange(rows)
        own = jnp.arange(rows) < live
        cols = n * _BLOCK_N + jnp.arange(_BLOCK_N)
        dtype = jnp.promote_types(x_ref.dtype, w_ref.dtype)

        def body(k, acc):
            ks = k * _BLOCK_K + jnp.arange(_BLOCK_K)
            x = c.load(x_ref.at[row[:, None], ks[None, :]], mask=own[:, None], other=0)
            w = c.load(w_ref.at[expert, ks[:, None], cols[None, :]])
            return acc + jnp.dot(x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)

        acc = jax.lax.fori_loop(0, num_k, body, jnp.zeros((rows, _BLOCK_N), jnp.float32))
        c.store(o_ref.at[row[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=own[:, None])


def grouped_matmul(
    rows: Float[Array, "M I"],
    weight: Float[Array, "E I O"],
    expert: Int[Array, " NT"],
    first_row: Int[Array, " NT"],
    live: Int[Array, " NT"],
    tile: int,
    *,
    interpret: bool | None = None,
) -> Float[Array, "M O"]:
    """Each tile's rows times its expert's weight, by the caller's tile schedule.

    Args:
      rows: the rows, sorted by expert.
      weight: every expert's weight (any float dtype; the dots run in the promoted dtype).
      expert, first_row, live: per tile, its expert, its first row and how many rows from there
        are its own (0: a spare tile). Every row must be some tile's own.
      tile: TM, the most rows a tile owns.
      interpret: run in the Pallas interpreter; None interprets unless the target is a GPU.

    Returns:
      `[M, O]` in `rows`' dtype.

    Raises:
      ValueError: I not a multiple of 64 or O not a multiple of 128 (`supports`).
    """
    num_rows, in_width = rows.shape
    out_width = weight.shape[-1]
    if not supports(in_width, out_width):
        raise ValueError(
            f"grouped_matmul takes input widths that are multiples of {_BLOCK_K} and output widths of "
            f"{_BLOCK_N}, not [{in_width}, {out_width}]; use jaxpaged.model.grouped_matmul's tile loop"
        )
    block_rows = max(16, c.next_pow2(tile))
    padded = jnp.pad(rows, ((0, block_rows), (0, 0)))  # a tile's block may reach past M (masked)
    kernel = functools.partial(_kernel, rows=block_rows, num_k=in_width // _BLOCK_K)
    out = c.pl.pallas_call(
        kernel,
        grid=(expert.shape[0], out_width // _BLOCK_N),
        out_shape=jax.ShapeDtypeStruct((num_rows + block_rows, out_width), rows.dtype),
        compiler_params=c.compiler_params(num_warps=_NUM_WARPS, num_stages=_NUM_STAGES),
        interpret=c.resolve_interpret(interpret),
        name="grouped_matmul",
    )(expert.astype(jnp.int32), first_row.astype(jnp.int32), live.astype(jnp.int32), padded, weight)
    return out[:num_rows]
