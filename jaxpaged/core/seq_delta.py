"""`SeqDelta`: what one sequence gained in one engine step, the engine core's whole output (host
only, no JAX). The output processor turns deltas into text and `RequestOutput`s, on the engine's
thread (`LLM`) or in the server process while the engine core steps in its own process; deltas
are small dataclasses of lists and numpy arrays, cheap to pickle.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxpaged.core.prompt_logprobs import PromptLogprobs
from jaxpaged.core.sequence import Sequence


@dataclasses.dataclass
class SeqDelta:
    """One sequence's news from one step (T new tokens, K = the request's `logprobs`).

    Attributes:
      request_id, index: the sequence (its request and which of the `n` samples).
      token_ids: the new tokens `[T]` (empty when it only finished, e.g. aborted).
      logprobs: each new token's log-probability `[T]` float32; None unless the request asked
        for logprobs.
      ranks: each new token's rank `[T]` int32 (0 when the step computed no top-k); with logprobs.
      top_ids: the top-K alternatives `[T, K]` int32; with logprobs.
      top_logprobs: their log-probabilities `[T, K]` float32; with logprobs.
      finish_reason: "stop", "length" or "abort" once the core finished it, else None.
      stop_reason: the stop token id that finished it, else None.
      error: with finish_reason "abort": why the request fails (`Sequence.error`), else None.
      num_cached_tokens: its tokens served by the prefix cache at its last admission.
      prompt_logprobs: the request's prompt logprobs, in the delta of its first token (first
        sequence only, when the request asked for them), else None.
    """

    request_id: str
    index: int
    token_ids: list[int]
    logprobs: np.ndarray | None = None
    ranks: np.ndarray | None = None
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None


def seq_delta(seq: Sequence, count: int, sample: Callable[[int], dict[str, Any]] | None = None) -> SeqDelta:
    """The delta of `seq` after a step appended its last `count` output tokens.

    The first delta with tokens carries the prompt logprobs (then `seq.prompt_logprobs_sent`).

    Args:
      seq: the sequence.
      count: how many tokens the step appended (0: it only finished).
      sample: `sample(j)`: the step's arrays for the j-th new token (`StepResult.sample`); needed
        when the request asks for logprobs.
    """
    tokens = seq.output_token_ids[len(seq.output_token_ids) - count :] if count else []
    delta = SeqDelta(
        seq.request_id,
        seq.index,
        tokens,
        finish_reason=seq.status.finish_reason,
        stop_reason=seq.stop_reason,
        error=seq.error,
        num_cached_tokens=seq.num_cached_tokens,
    )
    if count and seq.needs_prompt_logprobs:
        if not seq.prompt_logprobs.complete:
            raise RuntimeError(f"{seq} sampled before its prompt logprobs were all computed")
        delta.prompt_logprobs, seq.prompt_logprobs_sent = seq.prompt_logprobs, True
    k = seq.sampling_params.logprobs
    if k is None or not count:
        return delta
    samples = [sample(j) for j in range(count)]
    delta.logprobs = np.array([s["logprobs"] for s in samples], np.float32)
    if "top_ids" in samples[0] and samples[0]["top_ids"].size:
        delta.ranks = np.array([s["ranks"] for s in samples], np.int32)
        delta.top_ids = np.stack([s["top_ids"][:k] for s in samples]).astype(np.int32)
        delta.top_logprobs = np.stack([s["top_logprobs"][:k] for s in samples]).astype(np.float32)
    else:
        delta.ranks = np.zeros(count, np.int32)
        delta.top_ids = np.zeros((count, 0), np.int32)
        delta.top_logprobs = np.zeros((count, 0), np.float32)
    return delta
