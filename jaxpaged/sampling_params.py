"""Per-request sampling parameters, with vLLM's names, defaults and validation (host only).

`SamplingParams` is what a vLLM user passes to `LLM.generate` or sends to the OpenAI server:
the sampler on the device reads the numeric fields, the scheduler the token-id stop rules and
lengths, and the detokenizer the string stop rules and special-token handling.
"""

import dataclasses
import enum
import typing


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step` reports for a request (vLLM's names): everything so far, only
    what is new since the last output, or nothing until it finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# Temperatures below this are greedy, as in vLLM (`_SAMPLING_EPS`).
SAMPLING_EPS = 1e-5


def _bad(field: str, value: object, allowed: str) -> ValueError:
    shown = repr(value)
    if len(shown) > 64:  # a bounded prefix: values may be huge lists
        shown = f"{shown[:64]}... ({type(value).__name__} of {len(value)})" if hasattr(value, "__len__") else shown[:64]
    return ValueError(f"SamplingParams.{field} must be {allowed}, got {shown}")


# The device step holds these fields in int32 / float32 (see worker/step_fields.py).
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
# float32's smallest normal number: the device flushes smaller magnitudes to 0.
FLOAT32_TINY = 1.1754943508222875e-38


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite number a float32 can hold."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= FLOAT32_MAX


def check_text(name: str, text: object) -> None:
    """Text must be a str that UTF-8 can encode (a lone surrogate cannot: the tokenizer and the
    prefix-cache hash would fail on it later).

    Raises:
      ValueError: naming `name`, the problem and its position.
    """
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{name} holds an invalid character (a lone surrogate at position {err.start})") from None


# The constraint kinds of `StructuredOutputsParams`, exactly one of which a request sets.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@typing.no_type_check
@dataclasses.dataclass
class StructuredOutputsParams:
    """A constraint on a request's output (vLLM's `StructuredOutputsParams`, same names).

    Exactly one of `json`, `regex`, `choice`, `grammar`, `json_object` and `structural_tag` is set.

    Attributes:
      json: a JSON schema (a dict, or its JSON text); the output is a JSON document it accepts.
      regex: the output matches this regular expression in full.
      choice: the output is exactly one of these strings.
      grammar: a context-free grammar (Lark syntax, or GBNF/EBNF as llama.cpp writes it).
      json_object: True: the output is any JSON object.
      structural_tag: vLLM's structural tag (its JSON text): free text with tagged constrained parts.
      disable_any_whitespace: JSON without optional whitespace (jaxpaged's default is compact
        JSON either way: a model cannot spin on whitespace until `max_tokens`; see docs/structured-outputs.md).
      disable_additional_properties: a schema's objects take no properties it does not list.
      whitespace_pattern: the regex of whitespace allowed between JSON tokens (None: compact).
      disable_fallback: accepted for vLLM compatibility; jaxpaged has one backend and never
        falls back.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False

    def __post_init__(self):
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "StructuredOutputsParams takes exactly one of "
                f"{', '.join(STRUCTURED_KINDS)}; got {', '.join(given) if given else 'none'}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise _bad("structured_outputs.choice", self.choice, "a non-empty list of str")
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise _bad(f"structured_outputs.{name}", value, "a str")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise _bad("structured_outputs.json", self.json, "a JSON schema (a dict or its JSON text)")

    @property
    def kind(self) -> str:
        """Which constraint is set: one of `STRUCTURED_KINDS`."""
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind) not in (None, False))


# The class validates its own inputs (ints are fine for float fields, wrong types raise
# ValueError naming the field), so the test-time jaxtyping/beartype hook must not pre-empt it.
@typing.no_type_check
@dataclasses.dataclass
class SamplingParams:
    """How to sample one request's output; vLLM's names and defaults.

    Attributes:
      n: number of output sequences to generate from the prompt (parallel sampling).
      presence_penalty: in [-2, 2]; > 0 favours new tokens, < 0 repetition.
      frequency_penalty: in [-2, 2]; scales with each token's count in the output so far.
      repetition_penalty: > 0; > 1 discourages tokens seen in the prompt or output.
      temperature: >= 0; below 1e-5 sampling is greedy (see `greedy`).
      top_p: in (0, 1]; nucleus sampling, 1 is off.
      top_k: 0 or -1 is off (normalised to 0), otherwise >= 1.
      min_p: in [0, 1]; drop tokens below min_p times the top token's probability; 0 is off.
      seed: per-request seed; a seeded request samples the same tokens whatever its batch.
      stop: strings that end generation (checked by the detokenizer); a str becomes a list.
      stop_token_ids: token ids that end generation (checked by the scheduler).
      ignore_eos: keep generating past the model's EOS token.
      max_tokens: most tokens to generate (>= 1); None means up to `max_model_len`.
      min_tokens: EOS and `stop_token_ids` cannot end generation before this many tokens.
      logprobs: number of top log-probabilities to return per sampled token (plus the
        sampled token's own), or None for none.
      include_stop_str_in_output: keep the matched stop string in the text.
      skip_special_tokens: drop special tokens from the text.
      spaces_between_special_tokens: put spaces between special tokens in the text.
      output_kind: CUMULATIVE (default), DELTA (streaming) or FINAL_ONLY (offline batches).
      speculate: with a `speculative_config`, this request may be given proposals (False: it
        decodes one token per step). jaxpaged's own option, not vLLM's.
      structured_outputs: a constraint on the output (JSON schema, regex, choice, grammar).
      logit_bias: token id -> bias added to its logit before sampling (OpenAI's -100..100).
      allowed_token_ids: only these tokens may be sampled.
      bad_words: words (strings) the output may not contain, as the tokenizer encodes them.
      truncate_prompt_tokens: keep only the last k prompt tokens (-1: the last max_model_len).
      prompt_logprobs: number of top log-probabilities to return per prompt token (plus the
        prompt token's own), or None for none.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    speculate: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    # `stop_token_ids` as a set, made once: the scheduler looks each new token up in it.
    stop_token_id_set: frozenset = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.stop_token_id_set = frozenset(self.stop_token_ids)
        self._verify_args()
        if self.top_k == -1:
            self.top_k = 0
        if self.greedy:
            # Greedy ignores the filters; normalise them so the sampler sees "off".
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @staticmethod
    def _normalise_stop(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            return [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            raise _bad("stop", stop, "a str, a list of str or None")
        if any(s == "" for s in stop):
            raise _bad("stop", stop, "non-empty strings")
        return list(stop)

    @staticmethod
    def _normalise_stop_token_ids(ids) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple, set, frozenset)) or not all(_is_int(t) for t in ids):
            raise _bad("stop_token_ids", ids, "a list of int or None")
        if any(t < 0 for t in ids):
            raise _bad("stop_token_ids", ids, "non-negative token ids")
        return list(ids)

    def _verify_args(self) -> None:
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p"):
            if not _is_number(getattr(self, name)):
                raise _bad(name, getattr(self, name), "a finite number (float32 range)")
            if 0 < abs(getattr(self, name)) < FLOAT32_TINY:
                raise _bad(
                    name, getattr(self, name), f"0 or at least {FLOAT32_TINY:.8g} in magnitude (float32 rounds it to 0)"
                )
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)) or abs(getattr(self, name)) > INT32_MAX:
                raise _bad(name, getattr(self, name), f"an int (within ±{INT32_MAX})")
        for name in ("max_tokens", "logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or abs(value) > INT32_MAX):
                raise _bad(name, value, f"an int or None (within ±{INT32_MAX})")
        if self.seed is not None and not _is_int(self.seed):  # any int: the device folds it to 32 bits
            raise _bad("seed", self.seed, "an int or None")
        if any(t > INT32_MAX for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, f"token ids up to {INT32_MAX}")
        for s in self.stop:
            check_text("SamplingParams.stop", s)
        for name in (
            "ignore_eos",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "speculate",
        ):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "a bool")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise _bad("output_kind", self.output_kind, "a RequestOutputKind")
        if self.n < 1:
            raise _bad("n", self.n, "at least 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise _bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise _bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise _bad("repetition_penalty", self.repetition_penalty, "greater than 0")
        if not self.temperature >= 0.0:
            raise _bad("temperature", self.temperature, "non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k < -1:
            raise _bad("top_k", self.top_k, "0 or -1 (off) or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", self.min_p, "in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise _bad("max_tokens", self.max_tokens, "at least 1")
        if self.min_tokens < 0:
            raise _bad("min_tokens", self.min_tokens, "at least 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"at most max_tokens ({self.max_tokens})")
        if self.logprobs is not None and self.logprobs < 0:
            raise _bad("logprobs", self.logprobs, "non-negative")
        if self.temperature < SAMPLING_EPS and self.n > 1:
            raise _bad("n", self.n, "1 when using greedy sampling (temperature 0)")
        self._verify_token_controls()

    def _verify_token_controls(self) -> None:
        """Types and ranges of the structured-output and token-control fields (vocabulary bounds
        are the engine's to check: it knows the vocabulary)."""
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise _bad("structured_outputs", self.structured_outputs, "a StructuredOutputsParams or None")
        if self.structured_outputs is not None and self.min_tokens:
            # min_tokens bans EOS, which a complete document allows alone: nothing could be sampled
            raise _bad(
                "min_tokens",
                self.min_tokens,
                "0 with structured_outputs (the grammar decides where the output ends: EOS is allowed "
                "exactly when it accepts)",
            )
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                _is_int(k) and _is_number(v) for k, v in self.logit_bias.items()
            ):
                raise _bad("logit_bias", self.logit_bias, "a dict of int token id -> float bias")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise _bad("allowed_token_ids", ids, "a non-empty list of non-negative int token ids")
        if self.bad_words is not None:
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w for w in words):
                raise _bad("bad_words", words, "a list of non-empty str")
        for name in ("truncate_prompt_tokens", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or abs(value) > INT32_MAX):
                raise _bad(name, value, f"an int or None (within ±{INT32_MAX})")
        if (
            self.truncate_prompt_tokens is not None
            and self.truncate_prompt_tokens != -1
            and self.truncate_prompt_tokens < 1
        ):
            raise _bad("truncate_prompt_tokens", self.truncate_prompt_tokens, "-1 (max_model_len) or at least 1")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise _bad("prompt_logprobs", self.prompt_logprobs, "non-negative")

    @property
    def greedy(self) -> bool:
        """True when sampling is greedy (argmax): temperature below 1e-5, as in vLLM."""
        return self.temperature < SAMPLING_EPS
