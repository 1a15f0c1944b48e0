"""Per-step attention metadata: where this step's tokens sit and which pages each sequence owns."""

import dataclasses
import typing

import jax
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
