"""What the scheduler hands the runner for one sequence in one step (no JAX here)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step.

    Attributes:
      token_ids: the tokens computed this step (a prompt chunk, or the last sampled token).
      num_computed: tokens of this sequence already in the pool before this step.
      block_table: pool block ids owning its positions, in order; covers at least
        `num_computed + len(token_ids)` positions. Block 0 (the null block) is never in it.
    """

    token_ids: list[int]
    num_computed: int
    block_table: list[int]
