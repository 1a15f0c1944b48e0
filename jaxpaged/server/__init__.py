"""The OpenAI-compatible server (`jaxpaged serve`).

- `async_engine.AsyncEngine`: the `LLMEngine` on its own thread or in a child process, for asyncio
  callers.
- `protocol`: OpenAI request models and their `SamplingParams` (`chat_messages`: chat
  messages; `errors`: OpenAI's error shape).
- `fields`: the fields accepted with no effect or refused (docs/server.md's table); others are 400.
- `structured_request`: `response_format`, `structured_outputs`, `guided_*` -> one constraint.
- `tools`, `tool_parsers`: `tools` / `tool_choice` in, `tool_calls` out (whole and streamed).
- `serving`: the completions and chat-completions handlers (JSON and SSE), on
  `serving_context.ServingContext` (what they share; the checks every request passes).
- `prompts`: the engine's prompts (completions' prompts, the chat template, truncation, echo).
- `responses`: choices, usage and the JSON body (`logprobs_json`: logprobs as OpenAI's JSON).
- `event_stream`: SSE events and the client connection (a client gone aborts its requests).
- `app.build_app`: the FastAPI app (routes, API key, body limit, error handlers).
- `metrics.ServerMetrics`: Prometheus metrics with vLLM's names.
- `cli.serve`: start-up for the `jaxpaged serve` command.

Names are imported lazily: the CLI reads `cli`'s flags without loading JAX, and
`AsyncEngine` works without the `server` extra installed.
"""

import importlib

_EXPORTS = {
    "AsyncEngine": "jaxpaged.server.async_engine",
    "EngineDeadError": "jaxpaged.server.async_engine",
    "RequestStream": "jaxpaged.server.async_engine",
    "build_app": "jaxpaged.server.app",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxpaged.server' has no attribute {name!r}")
