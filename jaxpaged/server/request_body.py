"""Request bodies to request models, at a bounded cost to the event loop.

1. The body's bytes are read (the app's guard has capped them at `--max-request-body-bytes`).
2. Bodies over `OFF_LOOP_BYTES` are parsed and validated in a child process of their own
   (`BodyParser`), one at a time. `json.loads` holds the interpreter lock for the whole call
   (about 50 ms per MiB of integers, 150 ms per MiB of floats, on a 2-core CPU), so a parse on
   a thread of the server's process would keep the event loop (and `/health`) waiting for it.
   The child answers with the error, or with the body's data, which the server validates again
   (cheap: every list in it is within its limit, step 3). Smaller bodies are parsed on the loop.
3. Before any element is validated, each list field's length is checked against what the
   request can use (`max_model_len` tokens, `--max-sequences-per-request` prompts,
   `--max-stop-token-ids`, the vocabulary for `allowed_token_ids`, `MAX_BAD_WORDS`, `MAX_TOOLS`,
   and `max_model_len` for `/detokenize`'s `tokens`), so no field costs more than its limit
   allows.
4. Validation errors become one 400 naming at most `MAX_ERRORS_SHOWN` of them, each cut to a
   bounded length (list fields stop at their first bad element, see `protocol.py`).
"""

import dataclasses
import json
import multiprocessing
import signal

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
        _check_length("tokens", data.get("tokens"), self.max_model_len, tokens)  # /detokenize


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


def _load(raw: bytes, limits: ListLimits) -> dict:
    """The body's JSON object, its lists checked against `limits` (no element looked at)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as err:  # invalid UTF-8, or nesting deeper than Python recurses
        raise APIError(f"the body is not valid JSON: {echo(str(err))}") from None
    if not isinstance(data, dict):
        raise APIError(f"the body must be a JSON object, got {type(data).__name__}")
    limits.check(data)
    return data


def _validate(data: dict, model: type[BaseModel]) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as err:
        message, param = validation_message(err.errors(include_url=False, include_input=False))
        raise APIError(message, param=param) from None


class BodyParser:
    """A child process that parses and validates large bodies, so that no `json.loads` of theirs
    holds the server's interpreter lock. Started on first use; one body at a time (callers
    serialise); a child that died is replaced on the next use. It ignores SIGINT (Ctrl-C reaches
    the whole process group; the server decides) and exits when the server's end of the pipe
    closes."""

    def __init__(self):
        self.process = None

    def parse(self, raw: bytes, model: type[BaseModel], limits: ListLimits) -> BaseModel:
        """`model` from `raw`, parsed and checked in the child (called on a worker thread).

        Raises:
          APIError: the child's 400 for a bad body; 503 if the child died meanwhile.
        """
        if self.process is None or not self.process.is_alive():
            self._start()
        try:
            self._conn.send((raw, model, limits))
            answer = self._conn.recv()
        except (EOFError, OSError):
            self.process = None
            raise APIError("the request body's parser stopped; retry the request", 503) from None
        if isinstance(answer, dict):
            return _validate(answer, model)  # within the limits, so cheap; the child checked it
        message, param = answer
        raise APIError(message, param=param)

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")  # the server's threads do not survive a fork
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve_parses, args=(child,), name="jaxpaged-body-parser", daemon=True)
        self.process.start()
        child.close()  # the child's end lives in the child only: the server's exit closes its pipe


def _serve_parses(conn) -> None:
    """The parser child's loop: a body in, its data (validated) or its error's (message, param) out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            raw, model, limits = conn.recv()
        except EOFError:  # the server is gone
            return
        try:
            data = _load(raw, limits)
            _validate(data, model)
            conn.send(data)
        except APIError as err:
            conn.send((err.message, err.param))
        except Exception as err:  # noqa: BLE001 - e.g. data nested too deeply to send back: this body's 400
            why = "its JSON nests too deeply" if isinstance(err, RecursionError) else type(err).__name__
            conn.send((f"the request body could not be read: {why}", None))


_body_parser = BodyParser()


async def parse_body(request: Request, model: type[BaseModel], limits: ListLimits) -> BaseModel:
    """`model` from the request's JSON body (large bodies parsed in the `BodyParser` process).

    Raises:
      APIError: 400 for a body that is not JSON, a list over its limit, or a field of the wrong
        type or value (bounded messages naming the fields).
    """
    global _large_bodies
    raw = await request.body()
    if len(raw) <= OFF_LOOP_BYTES:
        return _validate(_load(raw, limits), model)
    if _large_bodies is None:
        _large_bodies = anyio.CapacityLimiter(1)
    return await anyio.to_thread.run_sync(_body_parser.parse, raw, model, limits, limiter=_large_bodies)
