"""What the scheduler hands the runner for one sequence in one step (no JAX here)."""

import dataclasses

from jaxpaged.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: everything the runner needs of it.

    Attributes:
      token_ids: the tokens computed this step (a prompt chunk, or the last sampled token, then
        any proposals it checks).
      num_computed: tokens of this sequence already in the pool (or written by steps in flight)
        before this step.
      block_table: pool block ids owning its positions, in order; covers at least
        `num_computed + len(token_ids)` positions. Block 0 (the null block) is never in it.
      seq_id: the sequence.
      from_last: its one token is the one the previous step sampled, not yet on the host:
        `token_ids` holds a placeholder and the device reads the token (async scheduling).
      samples: its last token yields a sampled token (a prefill chunk short of the prompt's end
        samples nothing).
      live_steps: of the step's fused decode steps, how many are its own (fewer when it reaches
        max_tokens or max_model_len inside the window: the rest write nothing and are dropped).
      params: its sampling parameters.
      index: which of its request's `n` samples it is.
      prompt_len: its prompt's tokens.
      admitted: it starts this step (admitted, or resumed after preemption): its penalty-table
        row is reset, or seeded with `prefix_token_ids`.
      prefix_token_ids: with `admitted` and penalties, the tokens whose K/V it reuses (prefix
        cache or swap); the step records only the tokens it computes.
      prompt_targets: with prompt logprobs still to compute, the prompt token after each of
        its computed prompt tokens (one fewer than `token_ids` when the chunk ends the prompt);
        None: none wanted.
      constraint: what it may sample (structured outputs, allowed_token_ids, bad_words; a
        `jaxpaged.structured.SequenceConstraint` up to date with its outputs), or None.
      num_forced: how many of `token_ids` after its first are tokens its constraint allows
        alone, computed without sampling (`SequenceConstraint.forced_run`); its sampling row
        follows them (and any proposals after them).
      lora_slot: its LoRA adapter's slot in the device's adapter pool (1..max_loras), 0 for the
        base model.
    """

    token_ids: list[int]
    num_computed: int
    block_table: list[int]
    seq_id: int = -1
    from_last: bool = False
    samples: bool = True
    live_steps: int = 1
    params: SamplingParams | None = None
    index: int = 0
    prompt_len: int = 0
    admitted: bool = False
    prefix_token_ids: list[int] | None = None
    prompt_targets: list[int] | None = None
    constraint: object | None = None
    num_forced: int = 0
    lora_slot: int = 0
