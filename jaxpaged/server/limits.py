"""The server's per-connection and per-request limits: each declared once here, with its flag.

Every request's cost on the event loop and on the engine thread is bounded by one of these
limits (or by `max_model_len` / `--max-sequences-per-request`), checked before the work:

- connections: how many may be open, how long one may take to send its headers, how long an
  idle one stays open, how large an unfinished header block may grow (uvicorn's names);
- bodies: their size in bytes, and the length of each list field (prompts, token ids, messages)
  before any element is validated;
- requests: `stop_token_ids` and `cache_salt` sizes, the response's size (every token and
  logprob it can hold: completions, prompt logprobs, echoed prompts), and a grammar's size and
  check time (`grammar_checks.py`), checked before the request reaches the engine;
- streams: a client that stops reading is disconnected after `stream_write_timeout`.
"""

import argparse
import dataclasses

from jaxpaged.entrypoints.cli_flags import flag_name

# Connections above `limit_concurrency` that are still accepted (and answered 503 by uvicorn),
# so probes and metrics scrapes reach a saturated server; more are closed as they open.
CONNECTION_HEADROOM = 64
# What a 503 at capacity (requests or connections) tells clients to wait, in seconds.
RETRY_AFTER_SECONDS = 1
# File descriptors the process keeps for itself beyond its connections (model files, logs, pipes).
RESERVED_FILES = 256


def _limit(default, help: str, metavar: str = "N"):
    return dataclasses.field(default=default, metadata=dict(help=help, metavar=metavar))


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Limits of `jaxpaged serve`; each field is the flag of the same name (`--timeout-header`)."""

    limit_concurrency: int = _limit(
        16384,
        "uvicorn's: with N connections (or requests) open, new requests get 503; more than "
        f"N+{CONNECTION_HEADROOM} connections are closed as they open (the file limit is raised to fit; "
        "default: 16384, or what the process's file limit leaves room for). Half-sent requests are "
        "closed after --timeout-header, so a high N costs an attacker time, not the probes their answers",
    )
    timeout_keep_alive: float = _limit(
        5.0, "uvicorn's: an idle keep-alive connection is closed after this many seconds", "SECONDS"
    )
    timeout_header: float = _limit(
        10.0,
        "a connection that has not sent a complete request header block this many seconds after it "
        "opened (or after its previous response) is closed",
        "SECONDS",
    )
    h11_max_incomplete_event_size: int = _limit(
        16 * 2**10, "uvicorn's (vLLM's flag): the most bytes of an unfinished request line and headers", "BYTES"
    )
    max_request_body_bytes: int = _limit(4 * 2**20, "larger request bodies get 413", "BYTES")
    max_stop_token_ids: int = _limit(1024, "the most stop_token_ids one request may give; more get 400")
    max_cache_salt_chars: int = _limit(1024, "the longest cache_salt one request may give; longer get 400", "CHARS")
    max_response_entries: int = _limit(
        2**20,
        "the response-size budget in tokens and logprobs: sequences x max_tokens x (1 + top logprobs), "
        "plus prompt tokens x (1 + prompt_logprobs) per choice with prompt_logprobs (or echo with "
        "logprobs), plus prompt tokens per choice with echo; requests above it get 400 (with max_tokens "
        "unset, the room left in max_model_len counts)",
    )
    max_grammar_bytes: int = _limit(
        128 * 2**10,
        "the largest structured-output constraint (a JSON schema or choices as compact JSON, a regex, "
        "a grammar), in bytes; larger get 400 before any work on them",
        "BYTES",
    )
    grammar_check_timeout: float = _limit(
        10.0,
        "a structured-output constraint still being checked after this many seconds gets 400 (one "
        "not yet started then, the checks busy with others, gets 503)",
        "SECONDS",
    )
    stream_write_timeout: float = _limit(
        30.0,
        "a streaming client that does not read for this many seconds is disconnected and its request aborted",
        "SECONDS",
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{flag_name(f.name)} {getattr(self, f.name)}: must be greater than 0")

    @property
    def max_connections(self) -> int:
        """Open connections past which new ones are closed as they open."""
        return self.limit_concurrency + CONNECTION_HEADROOM


def add_limit_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per `ServerLimits` field, with its help and default."""
    for f in dataclasses.fields(ServerLimits):
        kind = int if f.type in (int, "int") else float
        default = None if f.name == "limit_concurrency" else f.default  # sized to the file limit when unset
        parser.add_argument(
            flag_name(f.name), type=kind, default=default, metavar=f.metadata["metavar"], help=f.metadata["help"]
        )


def limits_from(args: argparse.Namespace) -> ServerLimits:
    """`ServerLimits` from parsed flags (checked: every limit must be positive); `--limit-concurrency`
    unset is its default, lowered to what the process's hard file limit leaves room for."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerLimits)}
    if values["limit_concurrency"] is None:
        default = ServerLimits.limit_concurrency
        values["limit_concurrency"] = max(1, min(default, files_allowed() - RESERVED_FILES - CONNECTION_HEADROOM))
    return ServerLimits(**values)


def files_allowed() -> int:
    """The most files this process may open (its hard limit; a large number when unlimited)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 2**31 - 1 if hard == resource.RLIM_INFINITY else hard
