"""What the engine makes of the tokens a step appended (host only, no JAX): each token's
logprobs, the completions' text (incremental detokenization), stop strings, and which requests
changed. A stop string finishes its sequence through one scheduler call
(`Scheduler.stop_on_string`), which also drops any tokens appended after it in the same step (a
fused window's, or accepted proposals').
"""

import logging
from collections.abc import Callable

from jaxpaged.core.request_state import RequestState
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.sequence import Sequence
from jaxpaged.worker.model_runner import StepResult

logger = logging.getLogger("jaxpaged")


class OutputProcessor:
    """Turns appended tokens into request state.

    Args:
      requests: the engine's unfinished requests by id (read; the engine adds and removes).
      scheduler: finishes sequences on stop strings.
      fail: called as `fail(request_id, error)` when a request's host work raises (that request
        fails; the engine goes on).

    Attributes:
      changed: ids of requests with news since the engine last collected outputs.
      num_generation_tokens: tokens handed to requests so far.
    """

    def __init__(self, requests: dict[str, RequestState], scheduler: Scheduler, fail: Callable[[str, Exception], None]):
        self.requests = requests
        self.scheduler = scheduler
        self.fail = fail
        self.changed: set[str] = set()
        self.num_generation_tokens = 0

    def process(self, appended: list[tuple[int, Sequence, int]], result: StepResult) -> None:
        """Records every appended token of a step (`Scheduler.postprocess`'s return value) with
        its logprobs from `result`."""
        for i, seq, count in appended:
            try:
                self._record(i, seq, count, result)
            except Exception as err:
                logger.exception("request %s failed; the engine goes on without it", seq.request_id)
                self.fail(seq.request_id, err)

    def _record(self, i: int, seq: Sequence, count: int, result: StepResult) -> None:
        state = self.requests[seq.request_id]
        completion = state.completions[seq.index]
        first = seq.num_output_tokens - count
        for j in range(count):
            token = seq.output_token_ids[first + j]
            sample = result.sample(i, j)
            self.num_generation_tokens += 1
            if "top_ids" in sample and sample["top_ids"].size:
                state.record_logprobs(
                    completion,
                    token,
                    float(sample["logprobs"]),
                    int(sample["ranks"]),
                    sample["top_ids"],
                    sample["top_logprobs"],
                )
            else:
                state.record_logprobs(completion, token, float(sample["logprobs"]), 0, (), ())
            if completion.detokenizer.add_token(token):
                self.scheduler.stop_on_string(seq, first + j + 1, completion.detokenizer.stop_reason)
                break
        self.changed.add(seq.request_id)
