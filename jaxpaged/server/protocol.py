"""OpenAI request models (plus vLLM's extra sampling fields), their `SamplingParams`, and errors.

Every field a model here declares is honoured; OpenAI's and vLLM's other fields are accepted
with no effect or refused by `fields.screen` (docs/server.md's table), and an unknown field is a 400
naming it. Field types are checked by pydantic; values by `SamplingParams` (one source of
truth), whose `ValueError` names the field.
"""

from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from jaxpaged.sampling_params import SamplingParams, StructuredOutputsParams
from jaxpaged.server import fields
from jaxpaged.server.chat_messages import ChatMessage
from jaxpaged.server.errors import APIError, api_error_from, echo, error_body  # noqa: F401 (re-exported)
from jaxpaged.server.structured_request import ResponseFormat, StructuredOutputsRequest, structured_outputs_of
from jaxpaged.server.tools import Tool, ToolChoice
from jaxpaged.worker.step_fields import MAX_LOGIT_BIAS

MAX_STOP_STRINGS = 16  # stop strings are matched on every new token; keep the list short
MAX_BAD_WORDS = 1024  # each is tokenized (twice) when the engine takes the request
MAX_TOOLS = 128  # OpenAI's limit on tools per request
MAX_N = 128
MAX_REQUEST_ID_CHARS = 256  # vLLM's request_id names the response and appears in logs
_INT32 = 2**31


def _list(item: Any) -> Any:
    """A list field whose validation stops at its first bad element: one error, not one per element."""
    return Annotated[list[item], Field(fail_fast=True)]


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
    """`stream_options`: `include_usage` adds a final chunk with `usage` and no choices; with it,
    vLLM's `continuous_usage_stats` puts the usage so far in every chunk too (without it, as in
    vLLM, it does nothing); other keys are a 400."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    response_format: ResponseFormat | None = None
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
    truncate_prompt_tokens: int | None = None
    bad_words: _list(str) | None = None
    allowed_token_ids: _list(int) | None = None
    # printable ASCII without spaces: it names the response and appears in logs (no forged log lines)
    request_id: Annotated[str, Field(max_length=MAX_REQUEST_ID_CHARS, pattern=r"^[!-~]+$")] | None = None
    # structured outputs (structured_request.py)
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: _list(str) | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None

    endpoint: ClassVar[str] = fields.BOTH
    _constraint_field: str | None = PrivateAttr(default=None)

    @property
    def constraint_field(self) -> str | None:
        """The field whose constraint `sampling_params` put in `structured_outputs` (for errors)."""
        return self._constraint_field

    @model_validator(mode="before")
    @classmethod
    def _screen_fields(cls, data: Any) -> Any:
        """No-effect and neutral refused fields dropped; others and unknown fields a 400 naming them."""
        return fields.screen(data, cls.model_fields, cls.endpoint) if isinstance(data, dict) else data

    def to_sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        vocab_size: int,
        structured: StructuredOutputsParams | None = None,
        prompt_logprobs: int | None = None,
        defaults: dict | None = None,
    ) -> SamplingParams:
        """The request's `SamplingParams` (`structured`: the output constraint, see
        `structured_request.structured_outputs_of`; `prompt_logprobs`: per prompt token;
        `defaults`: the model's generation config, for the fields the request leaves unset).

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
            structured_outputs=structured,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            bad_words=self.bad_words,
            allowed_token_ids=self.allowed_token_ids,
        )
        for name, value in (defaults or {}).items():  # vLLM: the generation config fills what is unset
            if values.get(name) is None:
                values[name] = value
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

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's `continuous_usage_stats`, with `include_usage`)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingRequest):
    """`POST /v1/completions`: `prompt` is a string, a list of strings, a token-id list, or a
    list of token-id lists (one completion request per prompt)."""

    prompt: str | _list(str) | _list(int) | _list(_list(int))
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extra: `prompt_logprobs` in each choice
    add_special_tokens: bool = True

    endpoint: ClassVar[str] = fields.COMPLETIONS

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the prompt (and its logprobs) alone, as vLLM answers."""
        return self.echo and self.max_tokens == 0

    def sampling_params(self, vocab_size: int, defaults: dict | None = None) -> SamplingParams:
        """`SamplingParams` (OpenAI's default max_tokens=16; `defaults`: the model's generation
        config for unset fields); 400 for suffix. With `echo` and
        `logprobs` the prompt's logprobs are computed too (`prompt_logprobs`, as vLLM does); with
        `echo` and max_tokens 0 one token is generated and dropped."""
        if self.suffix:
            raise APIError("suffix is not supported: there is no fill-in-the-middle", param="suffix")
        if self.stream and self.prompt_logprobs is not None:
            raise APIError("prompt_logprobs are not available when stream=true", param="prompt_logprobs")
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        max_tokens = 1 if self.echo_only else self.max_tokens
        structured, self._constraint_field = structured_outputs_of(self)
        return self.to_sampling_params(max_tokens, self.logprobs, vocab_size, structured, prompt_logprobs, defaults)


class ChatCompletionRequest(_SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: _list(dict[str, str]) | None = None
    structural_tag: str | None = None  # vLLM's older top-level form of structured_outputs.structural_tag
    tools: _list(Tool) | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    endpoint: ClassVar[str] = fields.CHAT

    def sampling_params(
        self, vocab_size: int, tool_schema: dict | None = None, defaults: dict | None = None
    ) -> SamplingParams:
        """`SamplingParams`: max_completion_tokens (or max_tokens, or the generation config's
        `max_new_tokens`, or up to max_model_len); `defaults`: the model's generation config;
        logprobs=true returns the sampled token's logprob plus `top_logprobs` alternatives;
        `tool_schema`: the schema `tool_choice` constrains the output to (`tools.tool_mode`)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if (
            self.continue_final_message
            and self.add_generation_prompt
            and "add_generation_prompt" in self.model_fields_set
        ):
            raise APIError(
                "continue_final_message and add_generation_prompt cannot both be true", param="continue_final_message"
            )
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        structured, self._constraint_field = structured_outputs_of(self, tool_schema)
        return self.to_sampling_params(max_tokens, logprobs, vocab_size, structured, defaults=defaults)

    def template_kwargs(self) -> dict[str, Any]:
        """What `apply_chat_template` receives beside the conversation (tools, documents, the
        client's `chat_template_kwargs`, which may not replace these)."""
        kwargs = dict(self.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & TEMPLATE_RESERVED)
        if reserved:
            raise APIError(
                f"chat_template_kwargs may not set {', '.join(map(repr, reserved))}", param="chat_template_kwargs"
            )
        continuing = self.continue_final_message
        kwargs.update(
            add_generation_prompt=self.add_generation_prompt and not continuing, continue_final_message=continuing
        )
        if self.tools:
            kwargs["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
        if self.documents:
            kwargs["documents"] = self.documents
        return kwargs


# apply_chat_template's own arguments: chat_template_kwargs cannot override them
TEMPLATE_RESERVED = frozenset(
    "conversation tools documents chat_template add_generation_prompt continue_final_message tokenize padding "
    "truncation max_length return_tensors return_dict return_assistant_tokens_mask tokenizer_kwargs".split()
)


class TokenizeRequest(Request):
    """vLLM's `POST /tokenize`: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: _list(ChatMessage) | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(Request):
    """vLLM's `POST /detokenize`."""

    model: str | None = None
    tokens: _list(int)
