"""Request bodies to request models, at a bounded cost to the event loop.

1. The body's bytes are read (the app's guard has capped them at `--max-request-body-bytes`).
2. Bodies over `OFF_LOOP_BYTES` are parsed and validated on a worker thread, one at a time: a
   4 MiB list of token ids takes a fraction of a second to parse, and the event loop must not
   wait on it. JSON parsing holds the interpreter lock for the whole call, so several at once
   would keep the event loop (and `/health`) waiting for all of them in turn; one at a time, it
   waits for at most one body's parse.
3. Before any element is validated, each list field's length is checked against what the
   request can use (`max_model_len` tokens, `--max-sequences-per-request` prompts,
   `--max-stop-token-ids`, the vocabulary for `allowed_token_ids`, `MAX_BAD_WORDS`, `MAX_TOOLS`),
   so no field costs more than its limit allows (`/detokenize`'s
   `tokens` are bounded by the body's size alone, as in vLLM).
4. Validation errors become one 400 naming at most `MAX_ERRORS_SHOWN` of them, each cut to a
   bounded length (list fields stop at their first bad element, see `protocol.py`).
"""

import dataclasses
import json

import anyio
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from jaxpaged.server.protocol import MAX_BAD_WORDS, MAX_STOP_STRINGS, MAX_TOOLS, APIError, echo

OFF_LOOP_BYTES = 64 * 2**10
MAX_ERRORS_SHOWN = 3
_large_bodies: anyio.CapacityLimiter | None = None  # one large body parsed at a time (made in the loop)


@dataclasses.dataclass(frozen=True)
class ListLimits:
    """The longest list each field may hold."""

    max_model_len: int
    max_sequences_per_request: int
    max_stop_token_ids: int
    vocab_size: int = 2**31 - 1

    def check(self, data: dict) -> None:
        """400 naming the field when a list is longer than its limit (no element is looked at)."""
        tokens = f"max_model_len ({self.max_model_len} tokens)"
        prompt = data.get("prompt")
        if isinstance(prompt, list):
            _check_length("prompt", prompt, max(self.max_model_len, self.max_sequences_per_request), tokens)
            for i, item in enumerate(prompt[: self.max_sequences_per_request]):
                if isinstance(item, list):
                    _check_length(f"prompt.{i}", item, self.max_model_len, tokens)
        _check_length("messages", data.get("messages"), self.max_model_len, tokens + ": one message per token")
        _check_length("stop_token_ids", data.get("stop_token_ids"), self.max_stop_token_ids, "--max-stop-token-ids")
        _check_length("stop", data.get("stop"), MAX_STOP_STRINGS, "stop strings per request")
        _check_length("allowed_token_ids", data.get("allowed_token_ids"), self.vocab_size, "the vocabulary's size")
        _check_length("bad_words", data.get("bad_words"), MAX_BAD_WORDS, "bad words per request")
        _check_length("tools", data.get("tools"), MAX_TOOLS, "tools per request")


def _check_length(field: str, value, limit: int, why: str) -> None:
    if isinstance(value, list) and len(value) > limit:
        raise APIError(f"{field}: at most {limit} items are accepted ({why}), got {len(value)}", param=field)


def validation_message(errors: list) -> tuple[str, str | None]:
    """A bounded message for pydantic's errors (the first few, each cut short) and the first field."""
    messages, param = [], None
    for e in errors[:MAX_ERRORS_SHOWN]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        param = param or (loc[0] if loc else None)
        messages.append(f"{echo('.'.join(loc)) or 'body'}: {echo(e.get('msg', ''))}")
    if len(errors) > MAX_ERRORS_SHOWN:
        messages.append(f"and {len(errors) - MAX_ERRORS_SHOWN} more error(s)")
    return "; ".join(messages) or "invalid request", param and echo(param)


def _parse(raw: bytes, model: type[BaseModel], limits: ListLimits) -> BaseModel:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # invalid UTF-8, or nesting deeper than Python recurses
        raise APIError(f"the body is not valid JSON: {echo(str(err))}") from None
    if not isinstance(data, dict):
        raise APIError(f"the body must be a JSON object, got {type(data).__name__}")
    limits.check(data)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        message, param = validation_message(err.errors(include_url=False, include_input=False))
        raise APIError(message, param=param) from None


async def parse_body(request: Request, model: type[BaseModel], limits: ListLimits) -> BaseModel:
    """`model` from the request's JSON body (large bodies parsed off the event loop).

    Raises:
      APIError: 400 for a body that is not JSON, a list over its limit, or a field of the wrong
        type or value (bounded messages naming the fields).
    """
    global _large_bodies
    raw = await request.body()
    if len(raw) <= OFF_LOOP_BYTES:
        return _parse(raw, model, limits)
    if _large_bodies is None:
        _large_bodies = anyio.CapacityLimiter(1)
    return await anyio.to_thread.run_sync(_parse, raw, model, limits, limiter=_large_bodies)
