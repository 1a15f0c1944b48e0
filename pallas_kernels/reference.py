"""Pure-jnp reference implementations of the paged-attention kernels.

Each function has exactly the signature of its Pallas counterpart, so tests compare the two
directly and the model can run on either. They are also the always-working path on CPU.

Dimension letters:
  T  tokens in the step (all sequences concatenated, padded)
  S  sequences (padded); B decode batch
  P  block-table width (pages per sequence)
  NB blocks in the pool; BS tokens per block
  N  query heads; K kv heads; G = N // K query heads per kv head; H head_dim

Pools are per layer, `[NB, BS, K, H]`. Block 0 is the reserved null block: padding tokens
write there and unused block-table entries point there, so no index is ever negative.

A float8 KV cache: `write_kv(..., quant_dtype=...)` stores `K / k_scale` and `V / v_scale` (one
float32 scale per kv head, `[K]`) rounded to float8, and the attention functions, given the same
scales, attend as if the pools held the dequantised values.
"""

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.platform import target_platform

# A large finite negative for masked logits: -inf would turn fully masked rows into NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# The window of a kernel call without one: longer than any context (a query sees every earlier key).
NO_WINDOW = 1 << 30
# Query rows per work item of the ragged reference.
QUERY_BLOCK = 64
# Traces inside `every_work_item()` run every work item of a bucket (see `ragged_paged_attention`).
_EVERY_ITEM = contextvars.ContextVar("every_work_item", default=False)


@contextlib.contextmanager
def every_work_item():
    """Traces inside this block run every work item of the bucket in `ragged_paged_attention`, as
    for a GPU, also on a CPU: a loop of static length, which reverse-mode differentiation needs
    (`jaxpaged.functional.token_logprobs` under `jax.grad`)."""
    token = _EVERY_ITEM.set(True)
    try:
        yield
    finally:
        _EVERY_ITEM.reset(token)


# The dtypes a quantised KV cache may be stored in (`write_kv(..., quant_dtype=...)`).
FLOAT8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def write_kv(
    k_pool: Float[Array, "NB BS K H"],
    v_pool: Float[Array, "NB BS K H"],
    k_new: Float[Array, "T K H"],
    v_new: Float[Array, "T K H"],
    slot_mapping: Int[Array, " T"],
    *,
    k_scale: Float[Array, " K"] | None = None,
    v_scale: Float[Array, " K"] | None = None,
    quant_dtype=None,
) -> tuple[Float[Array, "NB BS K H"], Float[Array, "NB BS K H"]]:
    """Scatters new K/V rows into the pools at `slot = block_id * BS + offset`.

    With `quant_dtype` (a float8 dtype) each row is stored quantised, `quantize(x, scale)`, in the
    pool's storage dtype (that float8 dtype, or float32 on CPU: the values are float8 either way).

    Updated in place when the pools are donated (the scatter aliases its operand). It indexes
    (block, offset) rather than a flattened [NB * BS, K, H] view: with one kv head (one device's
    share under tensor parallelism) XLA's CPU layout assignment gave that reshape another layout
    than the pool's and copied the whole pool on every step.

    Args:
      k_pool, v_pool: one layer's pools.
      k_new, v_new: this step's keys and values.
      slot_mapping: pool slot of each new token; padding tokens write into block 0.
      k_scale, v_scale: `[K]` float32 dequantisation scale per kv head (None: 1); only with
        `quant_dtype`.
      quant_dtype: None (rows are cast to the pool dtype), float8_e4m3fn or float8_e5m2.

    Raises:
      ValueError: scales without a `quant_dtype`, or a `quant_dtype` that is not float8.
    """
    if quant_dtype is not None:
        k_new, v_new = quantize(k_new, k_scale, quant_dtype), quantize(v_new, v_scale, quant_dtype)
    elif k_scale is not None or v_scale is not None:
        raise ValueError("k_scale / v_scale need a quant_dtype")
    block, offset = slot_mapping // k_pool.shape[1], slot_mapping % k_pool.shape[1]
    k = k_pool.at[block, offset].set(k_new.astype(k_pool.dtype))
    v = v_pool.at[block, offset].set(v_new.astype(v_pool.dtype))
    return k, v


def quantize(x: Float[Array, "T K H"], scale: Float[Array, " K"] | None, dtype) -> Array:
    """`x / scale[kv head]` in float32, saturated to the finite range of the float8 `dtype` (an
    out-of-range cast gives NaN in float8_e4m3fn, inf in float8_e5m2), then rounded to `dtype`.

    Raises:
      ValueError: `dtype` is not float8_e4m3fn or float8_e5m2.
    """
    if jnp.dtype(dtype) not in FLOAT8_DTYPES:
        raise ValueError(f"quant_dtype must be float8_e4m3fn or float8_e5m2, not {jnp.dtype(dtype).name}")
    x = x.astype(jnp.float32)
    if scale is not None:
        x = x / scale[:, None]
    limit = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -limit, limit).astype(dtype)


def _gather_pages(
    pool: Float[Array, "NB BS K H"], block_table: Int[Array, " P"], scale: Float[Array, " K"] | None
) -> Float[Array, "L K H"]:
    """The contiguous context of one sequence, L = P * BS, dequantised: the pool's values in
    float32 times `scale[kv head]` (None: 1)."""
    pages = pool[block_table].astype(jnp.float32)  # [P, BS, K, H]
    if scale is not None:
        pages = pages * scale[:, None]
    return pages.reshape(-1, *pool.shape[2:])


def _attend(
    q: Float[Array, "T N H"],
    k: Float[Array, "L K H"],
    v: Float[Array, "L K H"],
    mask: Array,  # bool [T, L]
    scale: float,
) -> Float[Array, "T N H"]:
    """Masked attention of T queries over one sequence's L float32 keys, softmax in float32."""
    t, n, h = q.shape
    kh = k.shape[1]
    qg = q.reshape(t, kh, n // kh, h)
    scores = jnp.einsum("tkgh,lkh->tkgl", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    # Zero V outside the valid keys: 0 * NaN from a poisoned page would still be NaN.
    v = jnp.where(mask.any(axis=0)[:, None, None], v, 0)
    out = jnp.einsum("tkgl,lkh->tkgh", probs, v)
    return out.reshape(t, n, h).astype(q.dtype)


def _in_window(key_pos: Array, q_pos: Array, window) -> Array | bool:
    """Whether each key is inside its query's sliding window (`key > query - window`; all of
    them without a window)."""
    return True if window is None else key_pos > q_pos - window


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
) -> Float[Array, "B N H"]:
    """One query token per sequence attending to its first `seq_lens[b]` pooled tokens.

    Args:
      q: the query of each sequence's newest token.
      k_pool, v_pool: one layer's pools, holding `K / k_scale` and `V / v_scale`.
      block_tables: pages of each sequence; unused entries point at block 0.
      seq_lens: tokens in the pool for each sequence, including the current one; 0 for
        padding rows, which come back as zeros.
      k_scale, v_scale: `[K]` float32 dequantisation scale per kv head (None: 1): attention
        reads `k_pool * k_scale[kv head]` and `v_pool * v_scale[kv head]`.
      scale: softmax scale, default `H ** -0.5`.
      window: sliding-window attention: a query at position p sees the keys at positions
        > p - window only (a Python or traced int >= 1; None: every earlier key).
      interpret: unused by the reference (kept for the kernel's signature).

    Returns:
      The attention output per query head.
    """
    del interpret
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    length = block_tables.shape[1] * k_pool.shape[1]

    def one(qb, table, n):
        pos = jnp.arange(length)
        mask = ((pos < n) & _in_window(pos, n - 1, window))[None, :]
        k, v = _gather_pages(k_pool, table, k_scale), _gather_pages(v_pool, table, v_scale)
        return _attend(qb[None], k, v, mask, scale)[0]

    return jax.vmap(one)(q, block_tables, seq_lens)


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
) -> Float[Array, "T N H"]:
    """Causal attention for any mix of decode tokens, prefills and prefill chunks.

    Token i of sequence s is the row `cu_q_lens[s] + i`; it sits at absolute position
    `kv_lens[s] - q_len[s] + i` and attends to that sequence's pooled positions up to its own.

    Args:
      q: queries of all sequences, concatenated; rows past `cu_q_lens[num_seqs]` are padding.
      k_pool, v_pool: one layer's pools, already holding this step's K/V (write-then-attend), as
        `K / k_scale` and `V / v_scale`.
      cu_q_lens: `[S + 1]` cumulative query lengths; entries past `num_seqs` repeat the total.
      kv_lens: context length of each sequence, including this step's tokens.
      block_tables: pages of each sequence; unused entries point at block 0.
      num_seqs: number of sequences actually present.
      k_scale, v_scale: `[K]` float32 dequantisation scale per kv head (None: 1): attention
        reads `k_pool * k_scale[kv head]` and `v_pool * v_scale[kv head]`.
      scale: softmax scale, default `H ** -0.5`.
      window: sliding-window attention: a query at position p sees the keys at positions
        > p - window only (a Python or traced int >= 1; None: every earlier key).
      interpret: unused by the reference (kept for the kernel's signature).

    Returns:
      The attention output; padding rows are zeros.
    """
    del interpret
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    num_tokens, num_slots = q.shape[0], block_tables.shape[0]
    length = block_tables.shape[1] * k_pool.shape[1]
    block_q = min(num_tokens, QUERY_BLOCK)
    # Work items: blocks of up to block_q consecutive tokens of one sequence. Each gathers its
    # sequence's pages once and attends for its rows only: O(T x L) work, not O(S x T x L). On a
    # CPU (where this reference serves the engine) only the live items run, a loop of
    # data-dependent length, so a step's padding (its bucket's unused rows and sequence slots)
    # costs nothing; for a GPU, where such a loop waits on the host every iteration, every item
    # of the bucket runs (dead ones masked).
    q_lens = jnp.where(jnp.arange(num_slots) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)
    q_padded = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))
    key_pos = jnp.arange(length)

    def one_item(w, out):
        s = jnp.minimum(jnp.searchsorted(ends, w, side="right"), num_slots - 1)
        first = cu_q_lens[s] + (w - (ends[s] - blocks[s])) * block_q
        rows = first + jnp.arange(block_q)
        row_ok = (w < ends[-1]) & (rows < cu_q_lens[s + 1])
        q_pos = kv_lens[s] - cu_q_lens[s + 1] + rows  # absolute position of each row
        seen = (key_pos[None, :] <= q_pos[:, None]) & _in_window(key_pos[None, :], q_pos[:, None], window)
        mask = row_ok[:, None] & seen
        q_rows = jax.lax.dynamic_slice_in_dim(q_padded, first, block_q)
        table = block_tables[s]
        k, v = _gather_pages(k_pool, table, k_scale), _gather_pages(v_pool, table, v_scale)
        o = _attend(q_rows, k, v, mask, scale)
        current = jax.lax.dynamic_slice_in_dim(out, first, block_q)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(row_ok[:, None, None], o, current), first, 0)

    max_items = -(-num_tokens // block_q) + num_slots
    num_items = ends[-1] if target_platform() == "cpu" and not _EVERY_ITEM.get() else max_items
    out = jax.lax.fori_loop(0, num_items, one_item, jnp.zeros_like(q_padded))
    return out[:num_tokens]
