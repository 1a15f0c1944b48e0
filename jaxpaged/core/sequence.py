"""One generated sequence's host state (no JAX here).

A request with `n` samples becomes `n` sequences sharing a `request_id`, told apart by
`index`. A sequence's tokens are its prompt followed by what it has generated; the pool holds (or the
steps in flight are writing) K/V for the first `num_computed_tokens` of them. With async
scheduling a step is scheduled before the previous one's tokens reach the host: those are the
sequence's `num_pending_tokens`, counted as its tokens when scheduling. A running sequence in
decode has exactly one uncomputed token: the one it sampled last, fed back in this step (read
on the device while it is still pending). After a preemption by recompute
`num_computed_tokens` is 0 and all tokens (prompt and outputs so far) are uncomputed.
"""

import enum
import itertools
import time

from jaxpaged.core.prompt_logprobs import PromptLogprobs
from jaxpaged.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life (vLLM's names)."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()  # EOS, a stop token id, or (from the detokenizer) a stop string
    FINISHED_LENGTH = enum.auto()  # max_tokens or max_model_len reached
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI/vLLM `finish_reason`: "stop", "length", "abort", or None while unfinished."""
        return {
            SequenceStatus.FINISHED_STOPPED: "stop",
            SequenceStatus.FINISHED_LENGTH: "length",
            SequenceStatus.FINISHED_ABORTED: "abort",
        }.get(self)


_seq_ids = itertools.count()


class Sequence:
    """A prompt and its generated tokens, with everything the scheduler tracks about them.

    Attributes:
      seq_id: process-unique id, in creation order.
      request_id: the request this sequence belongs to.
      index: which of the request's `n` samples this is.
      prompt_token_ids: the prompt.
      output_token_ids: tokens generated so far.
      sampling_params: how to sample it.
      status: a `SequenceStatus`.
      num_computed_tokens: leading tokens whose K/V are in the pool or written by scheduled steps.
      num_pending_tokens: tokens sampled by steps whose results the host has not read yet.
      num_cached_tokens: tokens served by the prefix cache (or a fork) at the last admission.
      block_table: pool block ids holding its positions, in order (never the null block 0).
      block_hashes: prefix-cache hashes of its full blocks, filled lazily by the block manager.
      arrival_time, first_token_time, finish_time: `time.time()` stamps (None until known).
      cache_salt: isolates this sequence's prefix-cache entries from other salts.
      stop_reason: the stop token id or stop string that finished it (None for EOS/length).
      error: why its request failed because of what the request asked (its grammar did not
        compile, allows nothing, or could not continue), with status FINISHED_ABORTED; else None.
      num_preemptions: how often it was preempted.
      spec_token_ids: a draft model's proposals for the tokens after its current ones (vLLM's
        name), from the output of the step that appended its newest tokens; the next step may
        check them (empty: none).
      prompt_logprobs: the request's prompt logprobs as steps compute them (its first sequence
        only, with `prompt_logprobs` set; else None); handed out once, with its first token.
      prompt_logprobs_sent: they were handed out (the sequence no longer needs them computed).
      constraint: what it may sample next (a `jaxpaged.structured.SequenceConstraint`: its
        grammar's matcher, allowed_token_ids, bad_words), advanced with each output token;
        None: unconstrained, or finished (released).
      lora: the LoRA adapter it runs with (its registration key, `LoraRegistry.register`), or None
        for the base model.
      lora_name: that adapter's name as requests give it (`LoRARequest.lora_name`), or None.
      lora_slot: the adapter's slot in the device's pool while it runs (`LoraSlots`), else 0.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None = None,
        *,
        index: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ):
        """Creates a waiting sequence.

        Args:
          request_id: the request's id.
          prompt_token_ids: the prompt's tokens (copied).
          sampling_params: defaults to `SamplingParams()`.
          index: which of the request's `n` samples this is.
          arrival_time: defaults to now.
          cache_salt: prefix-cache salt (vLLM's `cache_salt`), or None.
        """
        self.seq_id = next(_seq_ids)
        self.request_id = request_id
        self.index = index
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.cache_salt = cache_salt
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.spec_token_ids: list[int] = []
        k = self.sampling_params.prompt_logprobs
        self.prompt_logprobs = None if k is None or index else PromptLogprobs.empty(len(self.prompt_token_ids), k)
        self.prompt_logprobs_sent = False
        self.constraint = None
        self.lora: str | None = None
        self.lora_name: str | None = None
        self.lora_slot = 0

    def __repr__(self) -> str:
        return (
            f"Sequence(request_id={self.request_id!r}, index={self.index}, status={self.status.name}, "
            f"prompt={len(self.prompt_token_ids)}, output={len(self.output_token_ids)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens, pending ones included, whose K/V no scheduled step writes (1 for a sequence in
        decode)."""
        return self.num_tokens + self.num_pending_tokens - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Its prompt logprobs are still to compute: it computes its whole prompt (no prefix-cache
        hit, no fork) and its prompt chunks compute them."""
        return self.prompt_logprobs is not None and not self.prompt_logprobs_sent

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens `[start, end)` of the prompt followed by the outputs, without building that list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]
