"""Per-step attention metadata: where this step's tokens sit and which pages each sequence owns."""

import dataclasses
import typing

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int


@typing.no_type_check  # JAX rebuilds pytrees from non-array leaves (ArgInfo, specs)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """Device-side description of one ragged step (all fields padded to a shape bucket).

    Attributes:
      positions: `[T]` absolute position of each token (0 for padding).
      slot_mapping: `[T]` pool slot `block_id * block_size + offset` each token's K/V is
        written to; padding tokens write into the null block 0.
      cu_q_lens: `[S + 1]` cumulative query lengths; entries past `num_seqs` repeat the total.
      kv_lens: `[S]` context length per sequence including this step's tokens (0 for padding).
      block_tables: `[S, P]` pages of each sequence; unused entries are 0.
      num_seqs: `[]` sequences actually present.
      decode_only: static; every sequence has exactly one token and token i belongs to
        sequence i, so attention can use the decode kernel (split-K over the context).
    """

    positions: Int[Array, " T"]
    slot_mapping: Int[Array, " T"]
    cu_q_lens: Int[Array, " S1"]
    kv_lens: Int[Array, " S"]
    block_tables: Int[Array, "S P"]
    num_seqs: Int[Array, ""]
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def for_layer(self, first_block: Int[Array, ""], block_size: int) -> "AttentionMetadata":
        """The same step addressing one layer's blocks of a pool that holds every layer's blocks
        in a row (layer l's block b is `l * NB + b`, `first_block = l * NB`); padding still
        lands in that layer's null block."""
        return dataclasses.replace(
            self,
            slot_mapping=self.slot_mapping + first_block * block_size,
            block_tables=self.block_tables + first_block,
        )

    def microbatch(self, index: int, count: int) -> "AttentionMetadata":
        """Micro-batch `index` of `count` (pipeline parallelism): tokens
        `[index * T / count, (index + 1) * T / count)` of the step, as a step of their own that
        runs after the micro-batches before it have written their K/V.

        A sequence cut by a micro-batch boundary keeps its rows on either side: here its query
        rows are those inside the range, its context ends at its last token inside it; a sequence
        with no token inside has no query rows. A decode-only step's token i is sequence i, so the
        sequences are cut with the tokens (their rows of the tables padded to T first).
        """
        num_tokens = self.positions.shape[0]
        size = num_tokens // count
        first, stop = index * size, (index + 1) * size
        cut = dict(positions=self.positions[first:stop], slot_mapping=self.slot_mapping[first:stop])
        if self.decode_only:
            pad = num_tokens - self.kv_lens.shape[0]
            kv_lens = jnp.pad(self.kv_lens, (0, pad))[first:stop]
            tables = jnp.pad(self.block_tables, ((0, pad), (0, 0)))[first:stop]
            cu = jnp.arange(size + 1, dtype=self.cu_q_lens.dtype)
            num_seqs = jnp.clip(self.num_seqs - first, 0, size).astype(self.num_seqs.dtype)
            return dataclasses.replace(
                self, **cut, kv_lens=kv_lens, block_tables=tables, cu_q_lens=cu, num_seqs=num_seqs
            )
        ends = self.cu_q_lens[1:]
        later = ends - jnp.clip(ends, first, stop)  # each sequence's query rows after the range
        return dataclasses.replace(
            self,
            **cut,
            cu_q_lens=jnp.clip(self.cu_q_lens, first, stop) - first,
            kv_lens=jnp.maximum(self.kv_lens - later, 0),
        )

    def with_no_writes(self, idle=True) -> "AttentionMetadata":
        """The same step writing every token's K/V into the null block (an idle pipeline stage:
        its results are dropped, and it must not overwrite a sequence's K/V).

        Args:
          idle: True, or for metadata stacked over the pipeline's stages (`[P, ...]` fields) a
            `[P]` bool array: only the rows where it is True write nothing.
        """
        idle = jnp.asarray(idle, bool)
        idle = idle.reshape(idle.shape + (1,) * (self.slot_mapping.ndim - idle.ndim))
        return dataclasses.replace(
            self, slot_mapping=jnp.where(idle, 0, self.slot_mapping).astype(self.slot_mapping.dtype)
        )
