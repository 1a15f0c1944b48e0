"""The FastAPI app: OpenAI routes, vLLM's extra routes, auth, body limits and error shapes.

    POST /v1/completions, /v1/chat/completions   (serving.py; JSON or SSE)
    POST /v1/responses                           (openai_responses.py: a chat completion, as a response)
    GET  /v1/models, /metrics, /version
    GET  /health (readiness: 200 once serving), /live (liveness: 200 while the process answers)
    POST /tokenize, /detokenize                  (vLLM's shapes)
    POST /v1/completions/render, /v1/chat/completions/render   a request's prompt token ids (serving.py)
    /sleep, /wake_up, /pause, /resume, ...       with JAXPAGED_SERVER_DEV_MODE=1 only (dev_routes.py)
    /v1/load_lora_adapter, /v1/unload_lora_adapter   with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (lora_routes.py)
    POST /start_profile, /stop_profile           with --profiler-dir only (profile_routes.py)

CORS follows vLLM's flags and defaults (any origin, method and header; no credentials): a
preflight (`OPTIONS` with `Access-Control-Request-Method`) never needs the API key.

Every error is OpenAI's `{"error": {"message", "type", "param", "code"}}`: validation errors
and bad values are 400, an unknown model 404 (`model_not_found`), a missing or wrong API key
401 (also when more than one Authorization header is sent), an oversized body 413, an engine
that is starting, draining or at capacity 503 (at capacity with `Retry-After`), a stopped engine
503, a failure of the engine on one request 500. Messages name fields and values, never
internals. Request logs carry ids and token counts, never prompt text.
"""

import dataclasses
import hmac
import json
import logging
import time
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, Response

from jaxpaged.lora_request import LoRARequest
from jaxpaged.server.async_engine import (
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
    RequestFailedError,
)
from jaxpaged.server.data_parallel import EngineClient
from jaxpaged.server.dev_routes import add_dev_routes, dev_mode
from jaxpaged.server.limits import RETRY_AFTER_SECONDS, ServerLimits
from jaxpaged.server.lora_modules import runtime_updates
from jaxpaged.server.lora_routes import add_lora_routes
from jaxpaged.server.metrics import ServerMetrics
from jaxpaged.server.openai_responses import ResponsesRequest, create_response
from jaxpaged.server.profile_routes import add_profile_routes
from jaxpaged.server.prompts import chat_prompt
from jaxpaged.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    api_error_from,
    error_body,
)
from jaxpaged.server.request_body import parse_body, validation_message
from jaxpaged.server.serving import create_chat_completion, create_completion, render_chat, render_completion
from jaxpaged.server.serving_context import ServingContext

logger = logging.getLogger("jaxpaged.server")

# Probes and Prometheus scrape without the API key (as in vLLM, whose key guards only /v1).
UNAUTHENTICATED_PATHS = ("/health", "/live", "/metrics")


@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    """Cross-origin access from browsers: vLLM's `--allowed-origins`, `--allowed-methods`,
    `--allowed-headers` and `--allow-credentials`, with vLLM's defaults. No origins: no CORS
    headers at all (browsers then refuse cross-origin calls)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def build_app(
    async_engine: EngineClient,
    served_model_name: str | Sequence[str],
    api_key: str | None = None,
    log_prompts: bool = False,
    max_sequences_per_request: int = 1024,
    tokenizer_pool_size: int = 2,
    limits: ServerLimits | None = None,
    tool_call_parser: str | None = None,
    cors: CorsPolicy | None = None,
    chat_template: str | None = None,
    profiler_dir: str | None = None,
    lora_modules: dict[str, LoRARequest] | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over an `AsyncEngine` (which may still be starting).

    Args:
      async_engine: the engine (its thread keeps running after the app stops; shut it down).
      served_model_name: the `model` name clients use, or several (vLLM's `--served-model-name A B`:
        each is accepted and listed; the first names the metrics); others get 404.
      api_key: when set, every route but `UNAUTHENTICATED_PATHS` needs `Authorization: Bearer <api_key>`.
      log_prompts: request logs include the prompt text (off by default).
      max_sequences_per_request: prompts x n above this get 400.
      tokenizer_pool_size: threads that tokenize and detokenize off the event loop.
      limits: the body, request and stream limits (`ServerLimits()`'s defaults when None).
      tool_call_parser: the parser of `tool_choice: "auto"` replies (`tool_parsers.TOOL_PARSERS`);
        None refuses "auto" (vLLM's `--enable-auto-tool-choice` not given).
      cors: which browser origins may call (`CorsPolicy()`, vLLM's defaults, when None).
      chat_template: a Jinja chat template used instead of the tokenizer's (`--chat-template`).
      profiler_dir: where `POST /start_profile` traces to (`--profiler-dir`); None: no such routes.
      lora_modules: LoRA adapters requests may name as their `model` (`--lora-modules`), by name.
    """
    limits = limits or ServerLimits()
    app = FastAPI(title="jaxpaged", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    names = (served_model_name,) if isinstance(served_model_name, str) else tuple(served_model_name)
    ctx = ServingContext(
        async_engine,
        names,
        log_prompts,
        max_sequences_per_request,
        tokenizer_pool_size,
        limits,
        tool_call_parser,
        chat_template,
        dict(lora_modules or {}),
    )
    metrics = ServerMetrics(async_engine, names[0])
    created = int(time.time())
    app.state.ctx, app.state.metrics = ctx, metrics
    app.add_middleware(_Guard, api_key=api_key, max_body_bytes=limits.max_request_body_bytes)
    cors = cors or CorsPolicy()
    if cors.allowed_origins:  # outside the guard: preflights are answered here, and 401s carry CORS headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors.allowed_origins),
            allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers),
            allow_credentials=cors.allow_credentials,
        )
    _add_error_handlers(app)
    if dev_mode():  # /sleep, /wake_up, /pause, ... (vLLM's development mode)
        add_dev_routes(app, async_engine)
    if profiler_dir is not None:  # /start_profile, /stop_profile
        add_profile_routes(app, async_engine, profiler_dir)
    if runtime_updates():  # /v1/load_lora_adapter, /v1/unload_lora_adapter
        add_lora_routes(app, ctx)

    async def body_of(raw: Request, model):
        ctx.require_ready()  # the list limits need the engine's max_model_len
        return await parse_body(raw, model, ctx.list_limits)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await create_completion(ctx, await body_of(raw, CompletionRequest), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await create_chat_completion(ctx, await body_of(raw, ChatCompletionRequest), raw)

    @app.post("/v1/completions/render")
    async def completions_render(raw: Request) -> list[dict]:
        return await render_completion(ctx, await body_of(raw, CompletionRequest))

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(raw: Request) -> dict:
        return await render_chat(ctx, await body_of(raw, ChatCompletionRequest))

    @app.post("/v1/responses")
    async def responses(raw: Request) -> Response:
        return await create_response(ctx, await body_of(raw, ResponsesRequest), raw)

    @app.get("/v1/models")
    async def models() -> dict:
        ctx.require_ready()
        cards = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "jaxpaged",
                "root": names[0],
                "parent": None,
                "max_model_len": async_engine.config.max_model_len,
            }
            for name in names
        ]
        cards += [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "jaxpaged",
                "root": lora.lora_path,
                "parent": names[0],
                "max_model_len": async_engine.config.max_model_len,
            }
            for name, lora in ctx.lora_modules.items()
        ]
        return {"object": "list", "data": cards}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        """Readiness: 200 once the engine has compiled and serves; 503 while starting, draining or dead."""
        if async_engine.is_ready:
            return Response(status_code=200)
        state = "dead" if async_engine.dead else "draining" if async_engine.draining else "starting"
        return JSONResponse(error_body(f"not ready: {state}", "server_error"), status_code=503)

    @app.api_route("/live", methods=["GET", "HEAD"])
    async def live() -> Response:
        """Liveness: 200 while the process serves HTTP (also while the engine compiles)."""
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return {"version": version("jaxpaged")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict:
        body = await body_of(raw, TokenizeRequest)
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError("messages must not be empty", param="messages")
            request = ChatCompletionRequest(
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
            )
            tokens = (await chat_prompt(ctx, request))["prompt_token_ids"]
        else:
            ctx.check_text_length(len(body.prompt), "prompt")
            special = body.add_special_tokens
            tokens = await ctx.pool.run(lambda tok: tok.encode(body.prompt, add_special_tokens=special))
        return {
            "count": len(tokens),
            "max_model_len": async_engine.config.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict:
        body = await body_of(raw, DetokenizeRequest)
        ctx.check_model(body.model)
        vocab = async_engine.config.model.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": await ctx.pool.run(lambda tok: tok.decode(body.tokens))}

    return app


def _add_error_handlers(app: FastAPI) -> None:
    def reply(status: int, body: dict) -> JSONResponse:
        return JSONResponse(body, status_code=status)

    @app.exception_handler(APIError)
    async def api_error(_, err: APIError):
        return reply(err.status, err.body())

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, err: RequestValidationError | ValidationError):
        message, param = validation_message(err.errors())
        return reply(400, error_body(message, param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_, err: HTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return reply(err.status_code, error_body(str(err.detail), kind))  # the guard closes if the body is unread

    @app.exception_handler(ValueError)
    async def value_error(request, err: ValueError):
        if isinstance(err, ValidationError):  # a model built inside a handler: name the fields
            return await validation_error(request, err)
        return reply(400, api_error_from(err).body())

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_, err: EngineDeadError):
        return reply(503, error_body("the engine is not running", "server_error"))

    @app.exception_handler(EngineNotReadyError)
    async def not_ready(_, err: EngineNotReadyError):
        return reply(503, error_body(str(err), "server_error"))

    @app.exception_handler(EngineOverloadedError)
    async def overloaded(_, err: EngineOverloadedError):
        response = reply(503, error_body(str(err), "server_error", code="server_overloaded"))
        response.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)
        return response

    @app.exception_handler(RequestFailedError)
    async def request_failed(_, err: RequestFailedError):
        if err.error_type == "invalid_request_error":  # what the request asked failed (its grammar)
            return reply(400, error_body(str(err), err.error_type))
        return reply(500, error_body(f"the engine failed on this request: {err}", "server_error"))

    @app.exception_handler(Exception)
    async def internal_error(_, err: Exception):
        logger.error("internal error: %s: %s", type(err).__name__, err)
        return reply(500, error_body("internal server error", "server_error"))


class _Guard:
    """ASGI middleware: the API key check (not for CORS preflights, which carry no credentials) and
    the body-size cap, before any route runs."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        # A response sent before the whole body was read closes the connection: otherwise the
        # server would go on reading (and parsing) a body nobody wants, e.g. one byte per chunk.
        body_unread = b"transfer-encoding" in headers or length not in (b"", b"0")
        preflight = scope["method"] == "OPTIONS" and b"access-control-request-method" in headers
        if self.expected and scope["path"] not in UNAUTHENTICATED_PATHS and not preflight:
            given = [value for name, value in scope["headers"] if name == b"authorization"]
            if len(given) != 1 or not hmac.compare_digest(given[0], self.expected):
                message = "invalid or missing API key; send 'Authorization: Bearer <key>'"
                body = error_body(message, "authentication_error", code="invalid_api_key")
                return await _send_json(send, 401, body, close=body_unread)
        limit = self.max_body_bytes
        too_large = f"the request body exceeds the limit of {limit} bytes"
        if length.isdigit() and int(length) > limit:
            return await _send_json(send, 413, error_body(too_large), close=True)
        received = 0

        async def capped_receive():
            nonlocal received, body_unread
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, too_large)  # answered by the app's handler
                body_unread = body_unread and message.get("more_body", False)
            return message

        async def closing_send(message):
            if message["type"] == "http.response.start" and body_unread:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, capped_receive, closing_send)


async def _send_json(send, status: int, body: dict, close: bool = False) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
