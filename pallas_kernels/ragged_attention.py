"""Ragged paged attention: decode tokens, fresh prefills, prefix-cached prefills and prefill chunks
in one Pallas Triton kernel (the GPU counterpart of TPU "ragged paged attention").

1. XLA builds a small work list from `cu_q_lens` / `num_seqs`: item w is a block of up to BQ
   consecutive query tokens of one sequence (`seq, first token, end token`). Its static length
   bounds the number of blocks; items past the real work are empty.
2. The grid is (work item, kv head). A program loads its BQ tokens x G query heads as one
   [BQ * G, H] tile and walks the sequence's pages in BK-token tiles up to the causal limit of
   its last token: first the tiles every row sees in full (no mask), then the diagonal tiles.
3. Stores are masked to the item's real rows; empty items store nothing. The output starts as
   zeros (aliased), so padding tokens come back as zeros.

Quantised (float8) pools are read as they are, as in `decode_attention`: K/V tiles are cast to
the dots' compute dtype once loaded, k_scale multiplies the logits and v_scale the output.

GQA packing (rows = query tokens x G heads of one kv head) rather than a loop over heads: each
K/V tile is then read once per kv head instead of G times, and a decode token (BQ = 1 real
token) still fills G rows of the matrix unit instead of one.

Dimension letters as in `pallas_kernels.reference`.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import _common as c

# head_dim -> (rows per program BM = BQ * G, key tile BK, warps, pipeline stages). 128 x 64 tiles
# with 8 warps is the usual flash-attention shape for Hopper/Ampere at head_dim 128; 256 halves
# the row tile to bound registers (the f32 accumulator is BM x H).
# `tiles=` overrides the row for one call (benchmarks/gpu/attention_sweep.py times the choices).
_TILES = {64: (128, 64, 4, 2), 128: (128, 64, 8, 2), 256: (64, 32, 8, 2)}


def _work_list(cu_q_lens, num_seqs, block_q: int, max_work: int):
    """[3, W] int32: per work item its sequence, first token and end token (exclusive).

    A sequence's blocks are listed last block first: the blocks with the longest causal range
    start first, which shortens the tail of the grid. Items beyond the real work have
    first == end (empty) and sequence 0.
    """
    num_seqs_slots = cu_q_lens.shape[0] - 1
    q_lens = jnp.where(jnp.arange(num_seqs_slots) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)  # inclusive
    w = jnp.arange(max_work, dtype=jnp.int32)
    seq = jnp.minimum(jnp.searchsorted(ends, w, side="right"), num_seqs_slots - 1).astype(jnp.int32)
    first = cu_q_lens[seq] + (ends[seq] - 1 - w) * block_q  # local block index, counted from the end
    end = jnp.minimum(first + block_q, cu_q_lens[seq + 1])
    valid = w < ends[-1]
    return jnp.stack([jnp.where(valid, seq, 0), jnp.where(valid, first, 0), jnp.where(valid, end, 0)])


def _ragged_kernel(
    work_ref,  # [3, W]
    cu_ref,  # [S + 1]
    kv_lens_ref,  # [S]
    window_ref,  # [1]
    bt_ref,  # [S, P]
    q_ref,  # [T, K, G, H]
    k_ref,  # [NB * BS, K, H]
    v_ref,  # [NB * BS, K, H]
    k_scale_ref,  # [K]
    v_scale_ref,  # [K]
    zeros_ref,  # [T + 1, K, G, H], aliased to o_ref
    o_ref,  # [T + 1, K, G, H]; token row T takes the masked-off rows
    *,
    group: int,
    group_pow2: int,
    block_q: int,
    block_k: int,
    block_size: int,
    qk_scale: float,
):
    del zeros_ref  # only there to pre-zero the output
    w, h = c.pl.program_id(0), c.pl.program_id(1)
    seq, first, end = work_ref[0, w], work_ref[1, w], work_ref[2, w]
    num_tokens = q_ref.shape[0]
    offset = kv_lens_ref[seq] - cu_ref[seq + 1]  # absolute position of token t is t + offset

    r = jnp.arange(block_q * group_pow2)
    tok, g = first + r // group_pow2, r % group_pow2
    row_ok = (tok < end) & (g < group)
    g_safe = jnp.minimum(g, group - 1)
    q = c.load(c.rows_at(q_ref, jnp.minimum(tok, num_tokens - 1), h, g_safe), mask=row_ok[:, None], other=0)
    q_pos = tok + offset

    nonempty = end > first
    window = window_ref[0]
    kv_hi = jnp.where(nonempty, end + offset, 0)  # causal limit of the block's last token, + 1
    num_tiles = c.pl.cdiv(kv_hi, block_k)
    full_tiles = jnp.minimum(jnp.where(nonempty, (first + offset + 1) // block_k, 0), num_tiles)
    # Under a sliding window the tiles before the first row's window are skipped, and those
    # before the last row's window starts are masked as the diagonal ones are (none without one).
    first_tile = jnp.minimum(jnp.maximum(first + offset - window + 1, 0) // block_k, full_tiles)
    edge_tiles = jnp.clip(c.pl.cdiv(jnp.maximum(end - 1 + offset - window + 1, 0), block_k), first_tile, full_tiles)
    num_pages = bt_ref.shape[1]
    head_qk_scale = qk_scale * k_scale_ref[h]

    def body(j, carry, masked: bool):
        pos = j * block_k + jnp.arange(block_k)
        slots = c.kv_slots(bt_ref, seq, pos, block_size, num_pages)
        seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > q_pos[:, None] - window) if masked else None
        exists = (pos < kv_hi) & (pos > first + offset - window)  # none read before the first row's window
        return c.online_softmax_step(q, k_ref, v_ref, slots, h, exists, seen, carry, head_qk_scale)

    carry = c.init_carry(q.shape[0], q.shape[1])
    carry = jax.lax.fori_loop(first_tile, edge_tiles, functools.partial(body, masked=True), carry)
    carry = jax.lax.fori_loop(edge_tiles, full_tiles, functools.partial(body, masked=False), carry)
    acc, _, l = jax.lax.fori_loop(full_tiles, num_tiles, functools.partial(body, masked=True), carry)
    out = (acc * (v_scale_ref[h] / jnp.where(l == 0.0, 1.0, l))[:, None]).astype(o_ref.dtype)
    # Masked-off rows point at the spare token row T: never a real row, so even a store that
    # writes back old values (interpret mode) cannot race with a real one.
    c.store(c.rows_at(o_ref, jnp.where(row_ok, tok, num_tokens), h, g_safe), out, mask=row_ok[:, None])


def ragged_paged_attention(
    q: Float[Array, "T N H"],
    k_pool: Float[Array, "NB BS K H"],
    v_pool: Float[Array, "NB BS K H"],
    cu_q_lens: Int[Array, " S1"],
    kv_lens: Int[Array, " S"],
    block_tables: Int[Array, "S P"],
    num_seqs: Int[Array, ""],
    *,
    k_scale: Float[Array, " K"] | None = None,
    v_scale: Float[Array, " K"] | None = None,
    scale: float | None = None,
    window: int | Int[Array, ""] | None = None,
    interpret: bool | None = None,
    tiles: tuple[int, ...] | None = None,
) -> Float[Array, "T N H"]:
    """Causal attention for any mix of decode tokens, prefills and prefill chunks.

    Token i of sequence s is the row `cu_q_lens[s] + i`; it sits at absolute position
    `kv_lens[s] - q_len[s] + i` and attends to that sequence's pooled positions up to its own.

    Args:
      q: queries of all sequences, concatenated; rows past `cu_q_lens[num_seqs]` are padding.
      k_pool, v_pool: one layer's pools (any float dtype, float8 included), already holding this
        step's K/V (write-then-attend), as `K / k_scale` and `V / v_scale`.
      cu_q_lens: `[S + 1]` cumulative query lengths; entries past `num_seqs` repeat the total.
      kv_lens: context length of each sequence, including this step's tokens.
      block_tables: pages of each sequence; unused entries point at block 0 (never -1).
      num_seqs: number of sequences actually present.
      k_scale, v_scale: `[K]` float32 dequantisation scale per kv head (None: 1): attention
        reads `k_pool * k_scale[kv head]` and `v_pool * v_scale[kv head]`, never materialised:
        k_scale multiplies the logits, v_scale the output.
      scale: softmax scale, default `H ** -0.5`.
      window: sliding-window attention: a query at position p sees the keys at positions
        > p - window only, and the tiles before its block's first window are skipped (a
        Python or traced int >= 1; None: every earlier key).
      interpret: run the kernel in the Pallas interpreter; `None` interprets unless the
        default backend is a GPU.
      tiles: the tuning hook, `(rows, block_k, num_warps, num_stages)`, default
        `_TILES[head_dim]` (its rows raised to the group if smaller): rows = query tokens x GQA heads per program (a power of two >= 16
        and >= the group rounded up to a power of two), block_k keys per loop step (a power of
        two >= 16), Triton warps (a power of two) and software-pipeline stages (>= 1).
        Results do not depend on it, only speed (`benchmarks/gpu/attention_sweep.py`).

    Returns:
      The attention output `[T, N, H]` in q's dtype; padding rows are zeros.

    Raises:
      ValueError: head_dim not in (64, 128, 256), inconsistent head counts, or invalid `tiles`.
    """
    kh, group, hd = c.check_shapes(q, k_pool, v_pool)
    num_tokens, num_heads, _ = q.shape
    num_seq_slots = block_tables.shape[0]
    scale = hd**-0.5 if scale is None else float(scale)
    group_pow2 = c.next_pow2(group)
    if tiles is None:  # a group wider than the default rows gets one token per program
        rows, *rest = _TILES[hd]
        tiles = (max(rows, group_pow2), *rest)
    minimums = dict(rows=max(16, group_pow2), block_k=16, num_warps=1, num_stages=1)
    rows, block_k, num_warps, num_stages = c.check_tiles("ragged_paged_attention", tiles, minimums)
    block_q = rows // group_pow2
    # Each non-empty block holds >= 1 token, and at most one block per sequence is partial.
    max_work = max(1, min(num_tokens, -(-num_tokens // block_q) + num_seq_slots))

    cu_q_lens = cu_q_lens.astype(jnp.int32)
    work = _work_list(cu_q_lens, jnp.asarray(num_seqs, jnp.int32), block_q, max_work)
    k_flat, v_flat = c.flat_pools(k_pool, v_pool)
    zeros = jnp.zeros((num_tokens + 1, kh, group, hd), q.dtype)

    kernel = functools.partial(
        _ragged_kernel,
        group=group,
        group_pow2=group_pow2,
        block_q=block_q,
        block_k=block_k,
        block_size=k_pool.shape[1],
        qk_scale=scale * c.LOG2E,
    )
    out = c.pl.pallas_call(
        kernel,
        grid=(max_work, kh),
        out_shape=jax.ShapeDtypeStruct(zeros.shape, q.dtype),
        input_output_aliases={10: 0},
        compiler_params=c.compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=c.resolve_interpret(interpret),
        name="ragged_paged_attention",
    )(
        work,
        cu_q_lens,
        kv_lens.astype(jnp.int32),
        c.window_array(window),
        block_tables.astype(jnp.int32),
        q.astype(c.compute_dtype(q.dtype, k_pool.dtype)).reshape(num_tokens, kh, group, hd),
        k_flat,
        v_flat,
        *c.kv_scales(k_scale, v_scale, kh),
        zeros,
    )
    return out[:num_tokens].reshape(num_tokens, num_heads, hd)
