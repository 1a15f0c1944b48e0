"""OpenAI request models (plus vLLM's extra sampling fields), their `SamplingParams`, and errors.

Unknown fields are ignored, as OpenAI's server does. Field types are checked by pydantic;
values by `SamplingParams` (one source of truth), whose `ValueError` names the field.
"""

import re
from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator

from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.step_packer import MAX_LOGIT_BIAS

MAX_STOP_STRINGS = 16  # stop strings are matched on every new token; keep the list short
MAX_N = 128
MAX_ECHO_CHARS = 64  # error messages quote at most this much of a client's input
_INT32 = 2**31


def echo(text: str) -> str:
    """A bounded prefix of client input for an error message."""
    return text if len(text) <= MAX_ECHO_CHARS else f"{text[:MAX_ECHO_CHARS]}... ({len(text)} characters)"


def _list(item: Any) -> Any:
    """A list field whose validation stops at its first bad element: one error, not one per element."""
    return Annotated[list[item], Field(fail_fast=True)]


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def api_error_from(err: ValueError) -> APIError:
    """A 400 from a `SamplingParams` / engine `ValueError`, with `param` when the message names it."""
    match = re.search(r"SamplingParams\.(\w+)", str(err))
    return APIError(str(err).replace("SamplingParams.", ""), param=match.group(1) if match else None)


def _invalid_text(data: Any) -> str | None:
    """The path of the first string in `data` that UTF-8 cannot encode (a lone surrogate), if any."""
    stack = [((), data)]
    while stack:  # iterative: bodies may nest deeply
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return ".".join(map(str, path)) or "body"
        elif isinstance(value, dict):
            stack.extend(((*path, k), v) for k, v in value.items())
            stack.extend(((*path, "(key)"), k) for k in value)
        elif isinstance(value, list):
            stack.extend(((*path, i), v) for i, v in enumerate(value))
    return None


class Request(BaseModel):
    """Every request body: text anywhere in it must be valid Unicode (no lone surrogates), so
    nothing the engine or tokenizer cannot encode gets past the edge."""

    @model_validator(mode="before")
    @classmethod
    def _text_is_encodable(cls, data: Any) -> Any:
        path = _invalid_text(data)
        if path is not None:
            raise ValueError(f"{path} holds an invalid character (a lone surrogate); send valid Unicode text")
        return data


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a final chunk with `usage` and no choices."""

    include_usage: bool = False


class _SamplingRequest(Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | _list(str) | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None  # token id (a string in JSON) -> bias in [-100, 100]
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: _list(int) | None = None
    cache_salt: str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def to_sampling_params(
        self, max_tokens: int | None, logprobs: int | None, vocab_size: int, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The request's `SamplingParams`.

        Raises:
          APIError: a value out of range (400, naming the field) or an unsupported option.
        """
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(
                f"stop: at most {MAX_STOP_STRINGS} stop strings are supported, got {len(stop)}", param="stop"
            )
        if self.n > MAX_N:
            raise APIError(f"n: at most {MAX_N} completions per prompt are supported, got {self.n}", param="n")
        logit_bias = self._logit_bias(vocab_size) if self.logit_bias else None
        bad = [t for t in self.stop_token_ids or [] if not 0 <= t < vocab_size]
        if bad:
            raise APIError(
                f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", param="stop_token_ids"
            )
        seed = self.seed
        if seed is not None and not -_INT32 <= seed < _INT32:
            seed %= _INT32  # the device keys are 32-bit; fold larger seeds deterministically
        top_k = self.top_k if self.top_k is None or self.top_k <= vocab_size else vocab_size
        values = dict(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=seed,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=logit_bias,
            prompt_logprobs=prompt_logprobs,
        )
        try:
            return SamplingParams(**{k: v for k, v in values.items() if v is not None or k in ("max_tokens",)})
        except ValueError as err:
            raise api_error_from(err) from None

    def _logit_bias(self, vocab_size: int) -> dict[int, float]:
        """OpenAI's `logit_bias` (keys are token ids as strings) as ids -> floats: at most
        `MAX_LOGIT_BIAS` entries, ids in the vocabulary, biases in [-100, 100]; else a 400."""
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise APIError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are supported",
                param="logit_bias",
            )
        out = {}
        for key, value in self.logit_bias.items():
            try:
                token = int(key)
            except ValueError:
                raise APIError(
                    f"logit_bias keys must be token ids, got {echo(str(key))!r}", param="logit_bias"
                ) from None
            if not 0 <= token < vocab_size:
                raise APIError(
                    f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})", param="logit_bias"
                )
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise APIError(
                    f"logit_bias values must be numbers in [-100, 100], got {echo(repr(value))} for token {token}",
                    param="logit_bias",
                )
            out[token] = float(value)
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`: `prompt` is a string, a list of strings, a token-id list, or a
    list of token-id lists (one completion request per prompt)."""

    prompt: str | _list(str) | _list(int) | _list(_list(int))
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: `prompt_logprobs` in each choice

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its logprobs) alone, as vLLM answers."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, vocab_size: int) -> SamplingParams:
        """`SamplingParams` (OpenAI's default max_tokens=16); 400 for suffix. With `echo` and
        `logprobs` the prompt's logprobs are computed too (`prompt_logprobs`, as vLLM does); with
        `echo` and max_tokens 0 one token is generated and dropped."""
        if self.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if self.stream and self.prompt_logprobs is not None:
            raise APIError("prompt_logprobs are not available when stream=true", param="prompt_logprobs")
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self.to_sampling_params(max_tokens, self.logprobs, vocab_size, prompt_logprobs)


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: str
    content: str | _list(ContentPart) | None = None
    name: str | None = None

    def to_template(self) -> dict:
        """The message as the chat template wants it (text parts joined by newlines)."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError("only text content parts are supported", param="messages")
            content = "\n".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        return message


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def sampling_params(self, vocab_size: int) -> SamplingParams:
        """`SamplingParams`: max_completion_tokens (or max_tokens, or up to max_model_len);
        logprobs=true returns the sampled token's logprob plus `top_logprobs` alternatives."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.to_sampling_params(max_tokens, logprobs, vocab_size)


class TokenizeRequest(Request):
    """vLLM's `POST /tokenize`: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: _list(ChatMessage) | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Request):
    """vLLM's `POST /detokenize`."""

    model: str | None = None
    tokens: _list(int)
