"""The server's errors: OpenAI's error shape, and bounded echoes of client input in messages."""

import re

MAX_ECHO_CHARS = 64  # error messages quote at most this much of a client's input


def echo(text: str) -> str:
    """A bounded prefix of client input for an error message."""
    return text if len(text) <= MAX_ECHO_CHARS else f"{text[:MAX_ECHO_CHARS]}... ({len(text)} characters)"


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
