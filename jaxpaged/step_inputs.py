"""Host-side packing of one ragged step into padded numpy arrays (no JAX here).

A step holds, for each scheduled sequence, the tokens it computes now (a whole prompt, a
prompt chunk, or one decode token), how many of its tokens the pool already holds, and its
block table. `pack_step` lays them out as `AttentionMetadata` wants them, padded to fixed
bucket sizes so that the jitted step sees only a few shapes.
"""

import dataclasses

import numpy as np

NULL_BLOCK = 0


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step.

    Attributes:
      token_ids: the tokens computed this step (prompt chunk or the last sampled token).
      num_computed: tokens of this sequence already in the pool before this step.
      block_table: pool block ids owning its positions, in order; must cover
        `num_computed + len(token_ids)` positions.
    """

    token_ids: list[int]
    num_computed: int
    block_table: list[int]


@dataclasses.dataclass(frozen=True)
class PackedStep:
    """Padded numpy arrays of one step (letters as in `AttentionMetadata`).

    Attributes:
      token_ids: `[T]` int32, padding tokens are 0.
      positions: `[T]` int32.
      slot_mapping: `[T]` int32, padding writes go to the null block.
      cu_q_lens: `[S + 1]` int32, padded entries repeat the total.
      kv_lens: `[S]` int32, 0 for padding sequences.
      block_tables: `[S, P]` int32, unused entries are the null block.
      num_seqs: `[]` int32.
      last_token_index: `[S]` int32, row of each sequence's last token (0 for padding).
    """

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    block_tables: np.ndarray
    num_seqs: np.ndarray
    last_token_index: np.ndarray


def pack_step(
    seqs: list[ScheduledSequence], *, block_size: int, num_tokens: int, num_seqs: int, pages_per_seq: int
) -> PackedStep:
    """Packs scheduled sequences into arrays padded to `num_tokens`, `num_seqs` and `pages_per_seq`.

    Raises:
      ValueError: when the sequences do not fit the padded sizes or a block table is short.
    """
    total = sum(len(s.token_ids) for s in seqs)
    if total > num_tokens or len(seqs) > num_seqs:
        raise ValueError(f"{total} tokens / {len(seqs)} sequences do not fit the bucket ({num_tokens}, {num_seqs})")
    token_ids = np.zeros(num_tokens, np.int32)
    positions = np.zeros(num_tokens, np.int32)
    slot_mapping = np.zeros(num_tokens, np.int32)  # padding -> null block, slot 0
    cu_q_lens = np.full(num_seqs + 1, total, np.int32)
    kv_lens = np.zeros(num_seqs, np.int32)
    block_tables = np.full((num_seqs, pages_per_seq), NULL_BLOCK, np.int32)
    last_token_index = np.zeros(num_seqs, np.int32)
    start = 0
    for i, seq in enumerate(seqs):
        n = len(seq.token_ids)
        kv_len = seq.num_computed + n
        pages = -(-kv_len // block_size)
        if pages > len(seq.block_table) or pages > pages_per_seq:
            raise ValueError(
                f"sequence {i} needs {pages} blocks for {kv_len} tokens but has "
                f"{len(seq.block_table)} (bucket width {pages_per_seq})"
            )
        pos = np.arange(seq.num_computed, kv_len, dtype=np.int32)
        table = np.asarray(seq.block_table[:pages], np.int32)
        token_ids[start : start + n] = seq.token_ids
        positions[start : start + n] = pos
        slot_mapping[start : start + n] = table[pos // block_size] * block_size + pos % block_size
        cu_q_lens[i] = start
        kv_lens[i] = kv_len
        block_tables[i, :pages] = table
        last_token_index[i] = start + n - 1
        start += n
    return PackedStep(
        token_ids=token_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        cu_q_lens=cu_q_lens,
        kv_lens=kv_lens,
        block_tables=block_tables,
        num_seqs=np.array(len(seqs), np.int32),
        last_token_index=last_token_index,
    )


def bucket(n: int, minimum: int = 16) -> int:
    """The smallest power of two >= max(n, minimum): the padded size for `n` items."""
    size = minimum
    while size < n:
        size *= 2
    return size
