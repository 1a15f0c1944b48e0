"""Grouped matmul: rows sorted by expert, each group times its own expert's weight, with work
proportional to the rows (not to rows x experts).

Dimension letters: M rows (sorted by expert), I input width, O output width, E experts,
TM rows per tile, NT tiles.

`jax.lax.ragged_dot` computes the same thing, but JAX 0.10 on a CPU and XLA's GPU compiler (JAX
0.11, an H100) expand it into one dense product of every row with every expert, masked: E times
the work (benchmarks/results/moe_grouped_matmul.md). Here each expert's rows are cut into tiles of
TM rows (its last tile partly empty); a loop over the tiles multiplies each by its expert's
weight, read where it lies, and writes back the tile's own rows. The tile count is static:

    NT = (M + min(E, M) * (TM - 1)) // TM    (each non-empty group wastes < TM rows)

so the work is at most M + min(E, M) * (TM - 1) rows (the padding bound): with TM = 1 (decode,
M <= E) exactly M rows, whatever the number of experts. Tiles past the last group compute on
row 0 and write nothing.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# Rows per tile by rows per expert on average: small tiles waste little on few rows, larger ones
# make fewer, larger matmuls.
MAX_TILE_ROWS = 128


def tile_rows(num_rows: int, num_experts: int) -> int:
    """TM: a power of two near the average group size (1 when there are fewer rows than experts)."""
    average = max(1, num_rows // num_experts)
    return min(MAX_TILE_ROWS, 1 << (average.bit_length() - 1))


def num_tiles(num_rows: int, num_experts: int, tile: int) -> int:
    """NT: the most tiles any routing of `num_rows` rows over `num_experts` experts needs."""
    return (num_rows + min(num_experts, num_rows) * (tile - 1)) // tile


def tile_schedule(
    group_sizes: Int[Array, " E"], num_rows: int, tile: int
) -> tuple[Int[Array, " NT"], Int[Array, " NT"], Int[Array, " NT"]]:
    """Each tile's expert, first row, and rows of its own from there (0: a spare tile, past the
    last group: its first row is 0), for rows sorted by expert in groups of `group_sizes`."""
    num_experts = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes)
    tiles_of = (group_sizes + tile - 1) // tile
    tile_ends = jnp.cumsum(tiles_of)
    t = jnp.arange(num_tiles(num_rows, num_experts, tile), dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right"), num_experts - 1).astype(jnp.int32)
    first_row = ends[expert] - group_sizes[expert] + (t - (tile_ends[expert] - tiles_of[expert])) * tile
    live = jnp.where(t < tile_ends[-1], jnp.clip(ends[expert] - first_row, 0, tile), 0)  # the tile's own rows
    return expert, jnp.where(live > 0, first_row, 0), live


def grouped_matmul(
    rows: Float[Array, "M I"],
    group_sizes: Int[Array, " E"],
    expert_matmul: Callable[[Float[Array, "TM I"], Int[Array, ""]], Float[Array, "TM O"]],
    out_width: int,
    out_dtype=None,
) -> Float[Array, "M O"]:
    """Each group of `rows` times its expert's weight.

    Args:
      rows: the rows, sorted by expert (expert e's are `group_sizes[e]` rows after expert e-1's).
      group_sizes: rows per expert (summing to M).
      expert_matmul: `(tile, e) -> tile times expert e's weight` (plain or quantized).
      out_width: O.
      out_dtype: the result's dtype; None: `rows`' (float8 rows give float32 products).
    """
    num_rows, num_experts = rows.shape[0], group_sizes.shape[0]
    tile = tile_rows(num_rows, num_experts)
    expert, first_row, live = tile_schedule(group_sizes, num_rows, tile)
    padded = jnp.pad(rows, ((0, tile), (0, 0)))  # a last tile may reach past M

    def one_tile(out, i):
        x = jax.lax.dynamic_slice_in_dim(padded, first_row[i], tile)
        y = expert_matmul(x, expert[i]).astype(out.dtype)
        old = jax.lax.dynamic_slice_in_dim(out, first_row[i], tile)
        mine = (jnp.arange(tile) < live[i])[:, None]
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mine, y, old), first_row[i], 0), None

    out = jnp.zeros((num_rows + tile, out_width), rows.dtype if out_dtype is None else out_dtype)
    out, _ = jax.lax.scan(one_tile, out, jnp.arange(expert.shape[0]))
    return out[:num_rows]
