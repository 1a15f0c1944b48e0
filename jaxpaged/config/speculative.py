"""Speculative decoding options with vLLM's names (`speculative_config`), checked; no JAX here.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

    {"model": "/models/small", "num_speculative_tokens": 4}        (method "draft_model")

"ngram" (prompt lookup) proposes, for a sequence whose last n tokens (n from
`prompt_lookup_max` down to `prompt_lookup_min`) occurred earlier in its prompt or output, the up
to `num_speculative_tokens` tokens that followed that occurrence. "draft_model" runs a smaller
model with the same vocabulary for k decode steps. The target model checks every proposal of
every sequence in one step (see `jaxpaged.core.speculation`).
"""

import dataclasses
from typing import Any

from jaxpaged.config.checks import json_object

SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfigError(ValueError):
    """A bad `speculative_config`: names the key, its value and the fix."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Resolved speculative decoding options.

    Attributes:
      method: "ngram" (prompt lookup) or "draft_model".
      num_speculative_tokens: proposals checked per sequence and step (k).
      prompt_lookup_max, prompt_lookup_min: the longest and shortest suffix looked up (ngram).
      model: the draft model's directory or preset (draft_model: a smaller model with the
        target's vocabulary, run on the same devices with a KV pool of its own).
      disable_by_batch_size: no proposals while more sequences than this run (vLLM's option;
        None: no such limit; the measured rule of `jaxpaged.core.speculation` still applies).
      adaptive: speculate only while that has been measured faster than plain decoding at the
        batch size (`SpeculationGovernor`); False: in every step that can (jaxpaged's key).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    model: str | None = None
    disable_by_batch_size: int | None = None
    adaptive: bool = True

    @classmethod
    def parse(cls, value: "dict[str, Any] | str | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A config from a dict or its JSON text (None: speculation off).

        Raises:
          SpeculativeConfigError: unknown keys or methods, missing or out-of-range numbers.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, SpeculativeConfigError, '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "model",
            "disable_by_batch_size",
            "adaptive",
        }
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        method = value.get("method", "draft_model" if "model" in value else "ngram")
        if method not in SPECULATIVE_METHODS:
            raise SpeculativeConfigError(
                f"method {method!r} is not supported; use one of {', '.join(SPECULATIVE_METHODS)}"
            )
        model = value.get("model")
        if (method == "draft_model") != (model is not None):
            raise SpeculativeConfigError(
                "method 'draft_model' needs the draft's directory as \"model\" (and only it takes one)"
            )
        if model is not None and (not isinstance(model, str) or not model):
            raise SpeculativeConfigError(f"model={model!r} must be a model directory (or a preset with dummy weights)")
        k = value.get("num_speculative_tokens")
        lookup_max = value.get("prompt_lookup_max", 4)
        lookup_min = value.get("prompt_lookup_min", min(2, lookup_max) if isinstance(lookup_max, int) else 2)
        for name, number, low, high in (
            ("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS),
            ("prompt_lookup_max", lookup_max, 1, 64),
            ("prompt_lookup_min", lookup_min, 1, 64),
        ):
            if isinstance(number, bool) or not isinstance(number, int) or not low <= number <= high:
                raise SpeculativeConfigError(f"{name}={number!r} must be an integer in [{low}, {high}]")
        if lookup_min > lookup_max:
            raise SpeculativeConfigError(f"prompt_lookup_min={lookup_min} exceeds prompt_lookup_max={lookup_max}")
        limit = value.get("disable_by_batch_size")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise SpeculativeConfigError(f"disable_by_batch_size={limit!r} must be a positive integer (or absent)")
        adaptive = value.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise SpeculativeConfigError(f"adaptive={adaptive!r} must be true or false")
        return cls(method, k, lookup_max, lookup_min, model, limit, adaptive)
