"""What generation returns, with vLLM's names: `RequestOutput` holding `CompletionOutput`s."""

import dataclasses


@dataclasses.dataclass
class Logprob:
    """A token's log-probability, its rank among all tokens (1 = likeliest) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclasses.dataclass
class CompletionOutput:
    """One of a request's `n` completions.

    Attributes:
      index: which completion (0 .. n-1).
      text: the generated text (stop strings trimmed unless asked to keep them).
      token_ids: the generated tokens.
      cumulative_logprob: sum of the sampled tokens' log-probabilities (None unless logprobs).
      logprobs: per generated token, {token_id: Logprob} for the sampled token and the top-k.
      finish_reason: "stop", "length", "abort", or None while running.
      stop_reason: the stop string or stop token id that ended it, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestMetrics:
    """Wall-clock stamps (`time.time()`) of a request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclasses.dataclass
class RequestOutput:
    """A request's state: its prompt, its completions so far, and whether it has finished.

    In streaming (`LLMEngine.step` with delta outputs), `text` and `token_ids` of each
    completion hold only what is new since the previous output of the same request.

    `prompt_logprobs` (with `SamplingParams.prompt_logprobs`): None for the first prompt token,
    then per prompt token {token_id: Logprob} for that token and the top-k (vLLM's shape); in
    streaming, in the first output that has it only.

    `error` is set when the request failed (it is finished, its completions' `finish_reason`
    is "error", their text and tokens empty; other requests are unaffected); `error_type` says
    whose fault: "invalid_request_error" for what the request asked (its grammar did not
    compile, allows no output, or could not continue), "server_error" for the engine's.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    error_type: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
