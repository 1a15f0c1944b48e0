"""Host-side bookkeeping of one request's outputs: its completions' tokens, detokenizers,
logprobs and finish state, built from the engine core's `SeqDelta`s (no JAX)."""

import dataclasses

from jaxpaged.core.detokenizer import IncrementalDetokenizer, NoDetokenizer
from jaxpaged.core.prompt_logprobs import PromptLogprobs
from jaxpaged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams


@dataclasses.dataclass
class Completion:
    """One sequence's output side: its tokens, detokenizer, logprobs, finish state, and what has
    been reported so far."""

    index: int
    detokenizer: IncrementalDetokenizer | NoDetokenizer
    logprobs: list[dict[int, Logprob]] | None  # when streaming, only those not yet handed out
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    text: str = ""  # everything handed out so far
    reported_tokens: int = 0  # token ids handed out so far (for deltas)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestState:
    """A request's outputs as tracked between `add_request` and its final output.

    Args:
      request_id: the caller's id.
      prompt: the prompt text, if it came as text.
      prompt_token_ids: the tokenized prompt.
      params: its sampling parameters (`n` completions).
      tokenizer: for detokenization (None: token ids only, empty text).
      arrival_time: `time.time()` of arrival.

    `params.output_kind` decides what outputs carry: DELTA, new text and tokens only;
    CUMULATIVE or FINAL_ONLY, everything so far.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer,
        arrival_time: float,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival_time = arrival_time
        self.stream = params.output_kind is RequestOutputKind.DELTA
        self.final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        self.tokenizer = tokenizer
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None
        self._prompt_logprobs_reported = False
        self.completions = [
            Completion(
                index=i,
                detokenizer=NoDetokenizer()
                if tokenizer is None
                else IncrementalDetokenizer(
                    tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                    stop=params.stop,
                    include_stop_str_in_output=params.include_stop_str_in_output,
                ),
                logprobs=[] if params.logprobs is not None else None,
            )
            for i in range(params.n)
        ]

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def record_logprobs(
        self, completion: Completion, token_id: int, logprob: float, rank: int, top_ids, top_logprobs
    ) -> None:
        """Keeps the sampled token's logprob and the top `params.logprobs` alternatives."""
        completion.cumulative_logprob += logprob
        if completion.logprobs is None:
            return
        entry = {token_id: Logprob(logprob, rank, self._token_text(token_id))}
        for r, (tid, lp) in enumerate(zip(top_ids[: self.params.logprobs], top_logprobs), start=1):
            entry.setdefault(int(tid), Logprob(float(lp), r, self._token_text(int(tid))))
        completion.logprobs.append(entry)

    def record_prompt_logprobs(self, prompt: PromptLogprobs) -> None:
        """Keeps the prompt logprobs (vLLM's shape: None for the first token, then each prompt
        token's entry and the top `params.prompt_logprobs` alternatives)."""
        entries: list[dict[int, Logprob] | None] = [None]
        for j, token_id in enumerate(self.prompt_token_ids[1:]):
            entry = {token_id: Logprob(float(prompt.logprobs[j]), int(prompt.ranks[j]), self._token_text(token_id))}
            for r, (tid, lp) in enumerate(zip(prompt.top_ids[j].tolist(), prompt.top_logprobs[j].tolist()), start=1):
                entry.setdefault(tid, Logprob(lp, r, self._token_text(tid)))
            entries.append(entry)
        self.prompt_logprobs = entries

    def _token_text(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def make_output(self) -> RequestOutput:
        """The request's output now: deltas since the last call when streaming, else cumulative."""
        outs = []
        for c in self.completions:
            delta = c.detokenizer.take_delta(c.finished)
            c.text += delta
            new_tokens = c.token_ids[c.reported_tokens :]
            new_logprobs = c.logprobs
            if self.stream and c.logprobs is not None:
                # Handed out, not kept: a long request with top logprobs would otherwise keep
                # tokens x K `Logprob`s alive until it ends, for every full GC to walk.
                c.logprobs = []
            c.reported_tokens = len(c.token_ids)
            outs.append(
                CompletionOutput(
                    index=c.index,
                    text=delta if self.stream else c.text,
                    token_ids=new_tokens if self.stream else list(c.token_ids),
                    cumulative_logprob=c.cumulative_logprob if c.logprobs is not None else None,
                    logprobs=new_logprobs if self.stream else c.logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        prompt_logprobs = self.prompt_logprobs
        if self.stream:  # once, in the first output that has them
            prompt_logprobs = None if self._prompt_logprobs_reported else prompt_logprobs
            self._prompt_logprobs_reported |= prompt_logprobs is not None
        first_token_times = [c.first_token_time for c in self.completions if c.first_token_time]
        finish_times = [c.finish_time for c in self.completions if c.finish_time]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outs,
            finished=self.finished,
            num_cached_tokens=self.completions[0].num_cached_tokens,
            metrics=RequestMetrics(
                arrival_time=self.arrival_time,
                first_token_time=min(first_token_times, default=None),
                finished_time=max(finish_times) if self.finished and finish_times else None,
            ),
            prompt_logprobs=prompt_logprobs,
        )
