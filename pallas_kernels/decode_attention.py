"""Paged decode attention (one query token per sequence) as a Pallas Triton kernel.

Grid (sequence b, kv head h, split s). One program computes all G = N / K query heads of kv head
h together (GQA packing: each K/V tile is read once for the whole group; rows padded to >= 16 for
`dot`), over the s-th of `num_splits` equal slices of the sequence's *actual* length
(flash-decoding: small batches with long contexts still fill the GPU). Each split walks its
BK-token tiles, gathering pool slots from the block table, with an f32 online softmax in base 2.
It stores its normalised partial output and log-sum-exp; XLA combines the splits.

Longest first: program b of the grid computes sequence `order[b]`, the sequences sorted by length,
longest first (`longest_first`, the default), so the GPU, which starts programs in grid order,
starts the long ones first and ends on short ones instead of waiting for a long one started last
(a batch of ShareGPT lengths spans 10 to 2,000 tokens; with 1,024 sequences x 8 kv heads every
program is one whole sequence). The order is a permutation only: the same results.

Quantised (float8) pools are read as they are: each tile is cast to the dots' compute dtype once
loaded, the kv head's k_scale multiplies the logits and its v_scale the output, so no dequantised
copy of the pool ever exists.

Dimension letters as in `pallas_kernels.reference`.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels import _common as c

# Tiles (tokens of K/V per loop step) by head_dim: large tiles keep many bytes in flight, which
# is what a bandwidth-bound decode needs; the 256 variant halves it to bound shared memory.
_BLOCK_K = {64: 128, 128: 128, 256: 64}
_NUM_WARPS = 4
_NUM_STAGES = 2
# Programs wanted in flight: ~4 per SM on an H100 (132 SMs). Splits are added until reached.
_TARGET_PROGRAMS = 512
_MAX_SPLITS = 64


def num_splits(
    batch: int, num_kv_heads: int, max_pages: int, block_size: int, head_dim: int, block_k: int | None = None
) -> int:
    """Static split count: a power of two making batch x kv_heads x splits reach the target,
    capped so every split of a full-width sequence gets at least two tiles (of `block_k` tokens,
    default `_BLOCK_K[head_dim]`)."""
    block_k = _BLOCK_K[head_dim] if block_k is None else block_k
    max_tiles = -(-max_pages * block_size // block_k)
    wanted = c.next_pow2(-(-_TARGET_PROGRAMS // max(1, batch * num_kv_heads)))
    cap = max(1, c.next_pow2(max_tiles // 2 + 1) // 2)  # largest power of two <= max_tiles // 2
    return max(1, min(wanted, cap, _MAX_SPLITS))


def _decode_kernel(
    order_ref,  # [B]
    q_ref,  # [B, K, G, H]
    k_ref,  # [NB * BS, K, H]
    v_ref,  # [NB * BS, K, H]
    bt_ref,  # [B, P]
    lens_ref,  # [B]
    window_ref,  # [1]
    k_scale_ref,  # [K]
    v_scale_ref,  # [K]
    o_ref,  # [B, K, NS, Gp, H]
    lse_ref,  # [B, K, NS, Gp]
    *,
    group: int,
    rows: int,
    block_k: int,
    block_size: int,
    splits: int,
    qk_scale: float,
):
    b, h, s = order_ref[c.pl.program_id(0)], c.pl.program_id(1), c.pl.program_id(2)
    length = lens_ref[b]
    start = jnp.maximum(length - window_ref[0], 0)  # the first key in the query's window
    # Equal slices of the tiles the window covers: [lo, hi) tiles for this split.
    first_tile, tiles = start // block_k, c.pl.cdiv(length, block_k)
    per_split = c.pl.cdiv(tiles - first_tile, splits)
    lo = first_tile + s * per_split
    hi = jnp.minimum(lo + per_split, tiles)

    g = jnp.arange(rows)
    row_ok = g < group
    q = c.load(c.rows_at(q_ref, b, h, jnp.minimum(g, group - 1)), mask=row_ok[:, None], other=0)
    num_pages = bt_ref.shape[1]
    head_qk_scale = qk_scale * k_scale_ref[h]

    def body(j, carry):
        pos = j * block_k + jnp.arange(block_k)
        slots = c.kv_slots(bt_ref, b, pos, block_size, num_pages)
        seen = (pos < length) & (pos >= start)
        return c.online_softmax_step(q, k_ref, v_ref, slots, h, seen, None, carry, head_qk_scale)

    acc, m, l = jax.lax.fori_loop(lo, hi, body, c.init_carry(rows, q.shape[-1]))
    empty = l == 0.0  # this split got no tiles (short or padding sequence)
    l = jnp.where(empty, 1.0, l)
    c.store(o_ref.at[b, h, s], (acc * (v_scale_ref[h] / l)[:, None]).astype(o_ref.dtype))
    c.store(lse_ref.at[b, h, s], jnp.where(empty, c.MASK_VALUE, m + jnp.log2(l)))


def paged_decode_attention(
    q: Float[Array, "B N H"],
    k_pool: Float[Array, "NB BS K H"],
    v_pool: Float[Array, "NB BS K H"],
    block_tables: Int[Array, "B P"],
    seq_lens: Int[Array, " B"],
    *,
    k_scale: Float[Array, " K"] | None = None,
    v_scale: Float[Array, " K"] | None = None,
    scale: float | None = None,
    window: int | Int[Array, ""] | None = None,
    interpret: bool | None = None,
    tiles: tuple[int, ...] | None = None,
    longest_first: bool = True,
) -> Float[Array, "B N H"]:
    """One query token per sequence attending to its first `seq_lens[b]` pooled tokens.

    Args:
      q: the query of each sequence's newest token.
      k_pool, v_pool: one layer's pools (any float dtype, float8 included), holding
        `K / k_scale` and `V / v_scale`.
      block_tables: pages of each sequence; unused entries point at block 0 (never -1).
      seq_lens: tokens in the pool for each sequence, including the current one; 0 for
        padding rows, which come back as zeros.
      k_scale, v_scale: `[K]` float32 dequantisation scale per kv head (None: 1): attention
        reads `k_pool * k_scale[kv head]` and `v_pool * v_scale[kv head]`, never materialised:
        k_scale multiplies the logits, v_scale the output.
      scale: softmax scale, default `H ** -0.5`.
      window: sliding-window attention: the query sees the keys at positions > its own -
        window only, and the splits cover only the tiles those keys lie in (a Python or traced
        int >= 1; None: every earlier key).
      interpret: run the kernel in the Pallas interpreter; `None` interprets unless the
        default backend is a GPU.
      tiles: the tuning hook, `(block_k, num_warps, num_stages)`, default
        `(_BLOCK_K[head_dim], 4, 2)`: keys per loop step (a power of two >= 16; the split count
        follows it), Triton warps (a power of two) and software-pipeline stages (>= 1). Results
        do not depend on it, only speed (`benchmarks/gpu/attention_sweep.py`).
      longest_first: the grid visits the sequences longest first (a sort of `seq_lens`);
        False: in batch order. Results do not depend on it, only speed
        (`benchmarks/mixed_attention_gpu.py` times both on ShareGPT's lengths).

    Returns:
      The attention output per query head, `[B, N, H]` in q's dtype.

    Raises:
      ValueError: head_dim not in (64, 128, 256), inconsistent head counts, or invalid `tiles`.
    """
    kh, group, hd = c.check_shapes(q, k_pool, v_pool)
    batch, num_heads, _ = q.shape
    block_size = k_pool.shape[1]
    scale = hd**-0.5 if scale is None else float(scale)
    rows = max(16, c.next_pow2(group))
    default = (_BLOCK_K[hd], _NUM_WARPS, _NUM_STAGES)
    minimums = dict(block_k=16, num_warps=1, num_stages=1)
    block_k, num_warps, num_stages = c.check_tiles(
        "paged_decode_attention", default if tiles is None else tiles, minimums
    )
    splits = num_splits(batch, kh, block_tables.shape[1], block_size, hd, block_k)
    out_dtype = q.dtype if splits == 1 else jnp.float32
    k_flat, v_flat = c.flat_pools(k_pool, v_pool)

    kernel = functools.partial(
        _decode_kernel,
        group=group,
        rows=rows,
        block_k=block_k,
        block_size=block_size,
        splits=splits,
        qk_scale=scale * c.LOG2E,
    )
    o, lse = c.pl.pallas_call(
        kernel,
        grid=(batch, kh, splits),
        out_shape=(
            jax.ShapeDtypeStruct((batch, kh, splits, rows, hd), out_dtype),
            jax.ShapeDtypeStruct((batch, kh, splits, rows), jnp.float32),
        ),
        compiler_params=c.compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=c.resolve_interpret(interpret),
        name="paged_decode_attention",
    )(
        _visit_order(seq_lens, longest_first),
        q.astype(c.compute_dtype(q.dtype, k_pool.dtype)).reshape(batch, kh, group, hd),
        k_flat,
        v_flat,
        block_tables.astype(jnp.int32),
        seq_lens.astype(jnp.int32),
        c.window_array(window),
        *c.kv_scales(k_scale, v_scale, kh),
    )
    o, lse = o[:, :, :, :group], lse[:, :, :, :group]
    if splits > 1:
        # Combine the splits (base-2 log-sum-exp); empty splits carry MASK_VALUE, weight 0.
        # A padding row has only empty splits: equal weights over zero outputs give zero.
        w = jnp.exp2(lse - lse.max(axis=2, keepdims=True))
        o = (o * w[..., None]).sum(axis=2) / w.sum(axis=2)[..., None]
    else:
        o = o[:, :, 0]
    return o.reshape(batch, num_heads, hd).astype(q.dtype)


def _visit_order(seq_lens: Int[Array, " B"], longest_first: bool) -> Int[Array, " B"]:
    """The sequence each grid row computes: by length, longest first (ties in batch order), or
    the batch order."""
    if not longest_first:
        return jnp.arange(seq_lens.shape[0], dtype=jnp.int32)
    return jnp.argsort(-seq_lens.astype(jnp.int32), stable=True).astype(jnp.int32)
