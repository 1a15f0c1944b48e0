"""What becomes of the engine core's `SeqDelta`s (host only, no JAX): each token's logprobs, the
completions' text (incremental detokenization), stop strings, and one `RequestOutput` per
changed request. The same code serves both deployments: `LLMEngine.step` feeds it on the engine's
thread; the server feeds it in its own process, over the deltas the engine-core process sends
(`engine/core_process.py`), so detokenization stays off the engine's critical path.

A stop string finishes its completion here, at once and for good (later tokens are dropped), and
is reported to the core through `stop(request_id, index, num_output_tokens, stop)`; in the same
process that is `Scheduler.stop_on_string` at once, across processes a step or two later: the
core's surplus tokens for that sequence are dropped here, so the output is the same.
"""

import logging
import time
from collections.abc import Callable

from jaxpaged.core.request_state import Completion, RequestState
from jaxpaged.core.seq_delta import SeqDelta
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger("jaxpaged")


class OutputProcessor:
    """Turns the engine core's deltas into request state and outputs.

    Args:
      tokenizer: detokenizes (None: outputs carry token ids and empty text).
      stop: called as `stop(request_id, index, num_output_tokens, stop_string)` when a stop string
        finishes a completion (the core stops its sequence there).
      abort: called as `abort(request_id)` when a request's host work here raised (that request
        fails with an error output; the others go on).

    Attributes:
      requests: unfinished requests by id.
    """

    def __init__(
        self,
        tokenizer,
        stop: Callable[[str, int, int, str], None],
        abort: Callable[[str], None],
    ):
        self.tokenizer = tokenizer
        self.stop = stop
        self.abort = abort
        self.requests: dict[str, RequestState] = {}
        self._order: dict[str, int] = {}  # request id -> arrival rank (outputs come in that order)
        self._next = 0
        self._changed: set[str] = set()
        self._failed: dict[str, tuple[str, str]] = {}  # request id -> (why, error type), until output

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> None:
        """Tracks a request the core has accepted (its `params` resolved: `n`, `max_tokens`)."""
        self.requests[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, self.tokenizer, arrival_time
        )
        self._order[request_id], self._next = self._next, self._next + 1

    def process(self, deltas: list[SeqDelta]) -> None:
        """Records a step's deltas; deltas of requests no longer tracked here are ignored."""
        now = time.time()
        for delta in deltas:
            state = self.requests.get(delta.request_id)
            if state is None or delta.request_id in self._failed:
                continue  # finished or failed here first: the core's surplus
            if delta.error is not None:  # the request's own failure (its grammar): the whole request
                self._failed[delta.request_id] = (delta.error, "invalid_request_error")
                self.abort(delta.request_id)
                self._changed.add(delta.request_id)
                continue
            try:
                self._record(state, state.completions[delta.index], delta, now)
            except Exception as err:
                self._fail(delta.request_id, err)

    def _record(self, state: RequestState, completion: Completion, delta: SeqDelta, now: float) -> None:
        if completion.finished:
            return  # stopped here on a stop string before the core knew
        completion.num_cached_tokens = delta.num_cached_tokens
        if delta.prompt_logprobs is not None:
            state.record_prompt_logprobs(delta.prompt_logprobs)
        if delta.token_ids and completion.first_token_time is None:
            completion.first_token_time = now
        for j, token in enumerate(delta.token_ids):
            completion.token_ids.append(token)
            if delta.logprobs is not None:
                state.record_logprobs(
                    completion,
                    token,
                    float(delta.logprobs[j]),
                    int(delta.ranks[j]),
                    delta.top_ids[j],
                    delta.top_logprobs[j],
                )
            if completion.detokenizer.add_token(token):
                completion.finish_reason, completion.stop_reason = "stop", completion.detokenizer.stop_reason
                self.stop(delta.request_id, delta.index, len(completion.token_ids), completion.stop_reason)
                break
        else:
            completion.finish_reason, completion.stop_reason = delta.finish_reason, delta.stop_reason
        if completion.finished:
            completion.finish_time = now
        self._changed.add(delta.request_id)

    def outputs(self) -> list[RequestOutput]:
        """The outputs of requests that changed since the last call, in arrival order (for
        `RequestOutputKind.FINAL_ONLY` requests, only once they finish); finished requests are
        forgotten."""
        outputs = []
        for request_id in sorted(self._changed, key=self._order.__getitem__):
            state = self.requests[request_id]
            if state.final_only and not state.finished and request_id not in self._failed:
                continue
            output = self._guarded(request_id, state.make_output)
            outputs.append(output if output is not None else self._failed_output(request_id))
            if state.finished or request_id in self._failed:
                del self.requests[request_id], self._order[request_id]
        self._changed.clear()
        self._failed.clear()
        return outputs

    # -- failures of one request ------------------------------------------------------------

    def _guarded(self, request_id: str, fn, *args):
        """Runs one request's host work; if it raises, that request fails and the others go on."""
        if request_id in self._failed:
            return None
        try:
            return fn(*args)
        except Exception as err:
            self._fail(request_id, err)
            return None

    def _fail(self, request_id: str, err: Exception) -> None:
        """Fails one request (its host work raised): it is aborted and its output says why."""
        logger.exception("request %s failed; the engine goes on without it", request_id, exc_info=err)
        self._failed[request_id] = (f"processing the request failed ({type(err).__name__})", "server_error")
        self.abort(request_id)
        self._changed.add(request_id)

    def _failed_output(self, request_id: str) -> RequestOutput:
        state = self.requests[request_id]
        outs = [
            CompletionOutput(
                index=c.index, text="", token_ids=[], cumulative_logprob=None, logprobs=None, finish_reason="error"
            )
            for c in state.completions
        ]
        error, error_type = self._failed[request_id]
        return RequestOutput(
            request_id, state.prompt, state.prompt_token_ids, outs, finished=True, error=error, error_type=error_type
        )
