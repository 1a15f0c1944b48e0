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
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

# A large finite negative for masked logits: -inf would turn fully masked rows into NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Query rows per work item of the ragged reference.
QUERY_BLOCK = 64


def write_kv(
    k_pool: Float[Array, "NB BS K H"],
    v_pool: Float[Array, "NB BS K H"],
    k_new: Float[Array, "T K H"],
    v_new: Float[Array, "T K H"],
    slot_mapping: Int[Array, " T"],
) -> tuple[Float[Array, "NB BS K H"], Float[Array, "NB BS K H"]]:
    """Scatters new K/V rows into the pools at `slot = block_id * BS + offset`.

    Updated in place when the pools are donated (the scatter aliases its operand). It indexes
    (block, offset) rather than a flattened [NB * BS, K, H] view: with one kv head (one device's
    share under tensor parallelism) XLA's CPU layout assignment gave that reshape another layout
    than the pool's and copied the whole pool on every step.
    """
    block, offset = slot_mapping // k_pool.shape[1], slot_mapping % k_pool.shape[1]
    k = k_pool.at[block, offset].set(k_new.astype(k_pool.dtype))
    v = v_pool.at[block, offset].set(v_new.astype(v_pool.dtype))
    return k, v


def _gather_pages(
    pool: Float[Array, "NB BS K H"], block_table: Int[Array, " P"]
) -> Float[Array, "L K H"]:
    """The contiguous context of one sequence, L = P * BS."""
    pages = pool[block_table]  # [P, BS, K, H]
    return pages.reshape(-1, *pool.shape[2:])


def _attend(
    q: Float[Array, "T N H"],
    k: Float[Array, "L K H"],
    v: Float[Array, "L K H"],
    mask: Array,  # bool [T, L]
    scale: float,
) -> Float[Array, "T N H"]:
    """Masked attention of T queries over one sequence's L keys, softmax in float32."""
    t, n, h = q.shape
    kh = k.shape[1]
    qg = q.reshape(t, kh, n // kh, h)
    scores = jnp.einsum("tkgh,lkh->tkgl", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    # Zero V outside the valid keys: 0 * NaN from a poisoned page would still be NaN.
    v = jnp.where(mask.any(axis=0)[:, None, None], v, 0).astype(jnp.float32)
    out = jnp.einsum("tkgl,lkh->tkgh", probs, v)
    return out.reshape(t, n, h).astype(q.dtype)


def paged_decode_attention(
    q: Float[Array, "B N H"],
    k_pool: Float[Array, "NB BS K H"],
    v_pool: Float[Array, "NB BS K H"],
    block_tables: Int[Array, "B P"],
    seq_lens: Int[Array, " B"],
    *,
    scale: float | None = None,
    interpret: bool | None = None,
) -> Float[Array, "B N H"]:
    """One query token per sequence attending to its first `seq_lens[b]` pooled tokens.

    Args:
      q: the query of each sequence's newest token.
      k_pool, v_pool: one layer's pools.
      block_tables: pages of each sequence; unused entries point at block 0.
      seq_lens: tokens in the pool for each sequence, including the current one; 0 for
        padding rows, which come back as zeros.
      scale: softmax scale, default `H ** -0.5`.
      interpret: unused by the reference (kept for the kernel's signature).

    Returns:
      The attention output per query head.
    """
    del interpret
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    length = block_tables.shape[1] * k_pool.shape[1]

    def one(qb, table, n):
        mask = (jnp.arange(length) < n)[None, :]
        return _attend(qb[None], _gather_pages(k_pool, table), _gather_pages(v_pool, table), mask, scale)[0]

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
    scale: float | None = None,
    interpret: bool | None = None,
) -> Float[Array, "T N H"]:
    """Causal attention for any mix of decode tokens, prefills and prefill chunks.

    Token i of sequence s is the row `cu_q_lens[s] + i`; it sits at absolute position
    `kv_lens[s] - q_len[s] + i` and attends to that sequence's pooled positions up to its own.

    Args:
      q: queries of all sequences, concatenated; rows past `cu_q_lens[num_seqs]` are padding.
      k_pool, v_pool: one layer's pools, already holding this step's K/V (write-then-attend).
      cu_q_lens: `[S + 1]` cumulative query lengths; entries past `num_seqs` repeat the total.
      kv_lens: context length of each sequence, including this step's tokens.
      block_tables: pages of each sequence; unused entries point at block 0.
      num_seqs: number of sequences actually present.
      scale: softmax scale, default `H ** -0.5`.
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
    # sequence's pages once and attends for its rows only: O(T x L) work, not O(S x T x L).
    q_lens = jnp.where(jnp.arange(num_slots) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    blocks = (q_lens + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)
    max_items = -(-num_tokens // block_q) + num_slots
    item = jnp.arange(max_items)
    item_seq = jnp.minimum(jnp.searchsorted(ends, item, side="right"), num_slots - 1)
    item_first = cu_q_lens[item_seq] + (item - (ends[item_seq] - blocks[item_seq])) * block_q
    item_live = item < ends[-1]
    q_padded = jnp.pad(q, ((0, block_q), (0, 0), (0, 0)))
    key_pos = jnp.arange(length)

    def one_item(out, w):
        s, first = item_seq[w], item_first[w]
        rows = first + jnp.arange(block_q)
        row_ok = item_live[w] & (rows < cu_q_lens[s + 1])
        q_pos = kv_lens[s] - cu_q_lens[s + 1] + rows  # absolute position of each row
        mask = row_ok[:, None] & (key_pos[None, :] <= q_pos[:, None])
        q_rows = jax.lax.dynamic_slice_in_dim(q_padded, first, block_q)
        table = block_tables[s]
        o = _attend(q_rows, _gather_pages(k_pool, table), _gather_pages(v_pool, table), mask, scale)
        current = jax.lax.dynamic_slice_in_dim(out, first, block_q)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(row_ok[:, None, None], o, current), first, 0), None

    out, _ = jax.lax.scan(one_item, jnp.zeros_like(q_padded), item)
    return out[:num_tokens]
