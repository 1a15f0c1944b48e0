"""Speculative decoding options with vLLM's names (`speculative_config`), checked; no JAX here.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

"ngram" (prompt lookup) proposes, for a sequence whose last n tokens (n from
`prompt_lookup_max` down to `prompt_lookup_min`) occurred earlier in its prompt or output, the up
to `num_speculative_tokens` tokens that followed that occurrence. The target model checks every
proposal of every sequence in one step (see `jaxpaged.core.speculation`).
"""

import dataclasses
import json
from typing import Any

SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfigError(ValueError):
    """A bad `speculative_config`: names the key, its value and the fix."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Resolved speculative decoding options.

    Attributes:
      method: "ngram" (prompt lookup).
      num_speculative_tokens: proposals checked per sequence and step (k).
      prompt_lookup_max, prompt_lookup_min: the longest and shortest suffix looked up.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int

    @classmethod
    def parse(cls, value: "dict[str, Any] | str | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """A config from a dict or its JSON text (None: speculation off).

        Raises:
          SpeculativeConfigError: unknown keys or methods, missing or out-of-range numbers.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise SpeculativeConfigError(f"is not JSON ({err.msg} at character {err.pos})") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError("must be a JSON object such as "
                                         '{"method": "ngram", "num_speculative_tokens": 4}')  # fmt: skip
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(value) - known)
        if unknown:
            hint = " (a draft model is not supported yet)" if "model" in unknown else ""
            raise SpeculativeConfigError(f"unknown key(s) {', '.join(unknown)}{hint}; known: {', '.join(sorted(known))}")
        method = value.get("method", "ngram")
        if method not in SPECULATIVE_METHODS:
            raise SpeculativeConfigError(f"method {method!r} is not supported; use one of {', '.join(SPECULATIVE_METHODS)}")
        k = value.get("num_speculative_tokens")
        lookup_max = value.get("prompt_lookup_max", 4)
        lookup_min = value.get("prompt_lookup_min", min(2, lookup_max) if isinstance(lookup_max, int) else 2)
        for name, number, low, high in (("num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS),
                                        ("prompt_lookup_max", lookup_max, 1, 64), ("prompt_lookup_min", lookup_min, 1, 64)):  # fmt: skip
            if isinstance(number, bool) or not isinstance(number, int) or not low <= number <= high:
                raise SpeculativeConfigError(f"{name}={number!r} must be an integer in [{low}, {high}]")
        if lookup_min > lookup_max:
            raise SpeculativeConfigError(f"prompt_lookup_min={lookup_min} exceeds prompt_lookup_max={lookup_max}")
        return cls(method, k, lookup_max, lookup_min)
