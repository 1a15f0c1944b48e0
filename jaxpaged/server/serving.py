"""`/v1/completions` and `/v1/chat/completions`: prompts in, OpenAI responses or SSE chunks out.

Each handler checks that the engine is ready and the model name, turns the body into
`SamplingParams`, caps the request's sequences, bounds the prompt's length in characters,
tokenizes on the tokenizer threads (never on the event loop), checks lengths against
`max_model_len`, and adds all of its requests to the engine at once; only then does a response
start, so every bad request is a 400 with OpenAI's error shape. A client that goes away aborts
its requests.
"""

import asyncio
import dataclasses
import logging
import time
import uuid

from starlette.requests import Request
from starlette.responses import Response

from jaxpaged.sampling_params import RequestOutputKind
from jaxpaged.server.async_engine import RequestStream
from jaxpaged.server.event_stream import EventStreamResponse, run_until_disconnect, sse_events
from jaxpaged.server.prompts import chat_prompt, completion_prompts, echo_texts, truncate
from jaxpaged.server.protocol import ChatCompletionRequest, CompletionRequest
from jaxpaged.server.responses import Choice, Kind, Usage, render
from jaxpaged.server.serving_context import ServingContext
from jaxpaged.server.tools import tool_mode

logger = logging.getLogger("jaxpaged.server")


async def create_completion(ctx: ServingContext, body: CompletionRequest, raw: Request) -> Response:
    """`POST /v1/completions`: one engine request per prompt, choices indexed prompt-major."""
    lora = ctx.check_model(body.model)
    params = body.sampling_params(ctx.engine.config.model.vocab_size, ctx.sampling_defaults)
    num_prompts = (
        1 if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)) else len(body.prompt)
    )
    ctx.check_sequences(num_prompts, params.n)
    ctx.check_cache_salt(body.cache_salt)
    await ctx.check_structured(params, body.constraint_field)
    max_len = ctx.engine.config.max_model_len
    prompts = await completion_prompts(ctx, body.prompt, body.add_special_tokens)
    prompts = [truncate(p, params.truncate_prompt_tokens, max_len) for p in prompts]
    for p in prompts:
        ctx.check_length(len(p["prompt_token_ids"]), params.max_tokens, "prompt")
    lens = [len(p["prompt_token_ids"]) for p in prompts]
    ctx.check_response_size(lens, params, body.logprobs, echo=body.echo)
    kind = Kind(chat=False, num_logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs is not None)
    if body.echo:
        kind.echo = await echo_texts(ctx, prompts)
        kind.echo_only = body.echo_only
    return await _run(ctx, raw, body, params, prompts, kind, lora)


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, raw: Request) -> Response:
    """`POST /v1/chat/completions`: the conversation through the chat template, one request."""
    lora = ctx.check_model(body.model)
    vocab_size = ctx.engine.config.model.vocab_size

    def params_and_tools():
        tools = tool_mode(body, ctx.tool_call_parser)
        return body.sampling_params(vocab_size, tools.schema if tools else None, ctx.sampling_defaults), tools

    # tool schemas are copied into the required schema: megabytes of them never on the event loop
    params, tools = await ctx.run_blocking(params_and_tools) if body.tools else params_and_tools()
    ctx.check_sequences(1, params.n)
    ctx.check_cache_salt(body.cache_salt)
    await ctx.check_structured(params, body.constraint_field)
    prompt = truncate(await chat_prompt(ctx, body), params.truncate_prompt_tokens, ctx.engine.config.max_model_len)
    ctx.check_length(len(prompt["prompt_token_ids"]), params.max_tokens, "messages")
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    ctx.check_response_size([len(prompt["prompt_token_ids"])], params, num_logprobs)
    kind = Kind(chat=True, num_logprobs=num_logprobs, tools=tools)
    return await _run(ctx, raw, body, params, [prompt], kind, lora)


async def render_completion(ctx: ServingContext, body: CompletionRequest) -> list[dict]:
    """`POST /v1/completions/render`: the token ids each prompt of a completion request would run
    with (tokenized and truncated as `create_completion` does), `[{"token_ids": [...]}, ...]`;
    vLLM's router asks for them to match prompts against the engines' KV events."""
    ctx.check_model(body.model)
    params = body.sampling_params(ctx.engine.config.model.vocab_size, ctx.sampling_defaults)
    prompts = await completion_prompts(ctx, body.prompt, body.add_special_tokens)
    max_len = ctx.engine.config.max_model_len
    return [{"token_ids": truncate(p, params.truncate_prompt_tokens, max_len)["prompt_token_ids"]} for p in prompts]


async def render_chat(ctx: ServingContext, body: ChatCompletionRequest) -> dict:
    """`POST /v1/chat/completions/render`: the token ids a chat request would run with (its
    template, tools and documents rendered as `create_chat_completion` renders them),
    `{"token_ids": [...]}`."""
    ctx.check_model(body.model)
    keep, max_len = body.truncate_prompt_tokens, ctx.engine.config.max_model_len
    return {"token_ids": truncate(await chat_prompt(ctx, body), keep, max_len)["prompt_token_ids"]}


def replica_rank(raw: Request) -> int | None:
    """The engine replica a request asks for: vLLM's `X-data-parallel-rank` header (a router
    that tracks each replica's KV cache sends it), or None.

    Raises:
      ValueError: the header is not an integer.
    """
    text = raw.headers.get("x-data-parallel-rank")
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"X-data-parallel-rank {text!r}: expected an engine replica's rank (an integer)") from None


async def _run(ctx, raw: Request, body, params, prompts: list[dict], kind: Kind, lora=None) -> Response:
    engine_id = f"{kind.prefix}-{uuid.uuid4().hex}"
    ids = [f"{engine_id}-{i}" for i in range(len(prompts))]
    # vLLM's request_id names the response; the engine's ids stay unique whatever clients send
    request_id = f"{kind.prefix}-{body.request_id}" if body.request_id else engine_id
    if not body.stream:  # one output when done (as vLLM asks): its decode steps may be fused
        params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
    stream = await ctx.engine.add_requests(
        ids, prompts, params, cache_salt=body.cache_salt, lora_request=lora, data_parallel_rank=replica_rank(raw)
    )
    logger.info(
        "%s: %d prompt(s), %d prompt tokens, n=%d, max_tokens=%s, stream=%s",
        request_id,
        len(prompts),
        sum(len(p["prompt_token_ids"]) for p in prompts),
        params.n,
        params.max_tokens,
        body.stream,
    )
    if ctx.log_prompts:
        for rid, p in zip(ids, prompts):
            logger.info("%s: prompt %r", rid, p.get("prompt") or p["prompt_token_ids"])
    head = {
        "id": request_id,
        "object": kind.object(body.stream),
        "created": int(time.time()),
        "model": ctx.response_model(body.model),
    }
    index_of = {rid: i * params.n for i, rid in enumerate(ids)}
    if kind.echo is not None:
        kind.prompt_of = {rid: i for i, rid in enumerate(ids)}
    if body.stream:
        # The response starts with the first output: a failure before it (the engine, or its
        # replica, died; the request's grammar failed) is an HTTP error a router can retry
        # elsewhere, not a 200 whose stream breaks with nothing in it.
        started = await run_until_disconnect(raw, Started.first_of(stream))
        if started is None:
            stream.abort()
            logger.info("%s: client disconnected before the first token; aborted", request_id)
            return Response(status_code=499)
        stream = started
        usage = Usage({rid: len(p["prompt_token_ids"]) for rid, p in zip(ids, prompts)})
        num_choices = params.n * len(prompts)
        events = sse_events(stream, kind, head, index_of, num_choices, usage, body.include_usage, body.continuous_usage)
        return EventStreamResponse(events, on_close=stream.abort, write_timeout=ctx.limits.stream_write_timeout)
    result = await run_until_disconnect(raw, _collect(stream, kind, index_of))
    if result is None:
        logger.info("%s: client disconnected; aborted", request_id)
        return Response(status_code=499)
    choices, usage = result
    # Only the joining of finished JSON fragments is left (megabytes at most: one C call each).
    content = await asyncio.to_thread(render, kind, head, choices, usage)
    logger.info("%s: finished, %d completion tokens, %d response bytes", head["id"], usage.completion, len(content))
    return Response(content, media_type="application/json")


class Started:
    """A stream of outputs whose first output has come (it is iterated again from that one)."""

    def __init__(self, stream, first: list):
        self._stream, self._first = stream, first

    @classmethod
    async def first_of(cls, stream) -> "Started":
        """Waits for `stream`'s first output (raises the stream's error if it fails first)."""
        try:
            return cls(stream, [await stream.__anext__()])
        except StopAsyncIteration:  # nothing at all (e.g. aborted): iterating ends at once
            return cls(stream, [])

    def __aiter__(self) -> "Started":
        return self

    async def __anext__(self):
        if self._first:
            return self._first.pop()
        return await self._stream.__anext__()

    def abort(self) -> None:
        """Aborts the underlying stream's unfinished requests."""
        self._stream.abort()


async def _collect(stream: RequestStream, kind: Kind, index_of: dict) -> tuple[dict[int, Choice], Usage]:
    """Every output of the stream (one per request, when it is done: the request is FINAL_ONLY),
    accumulated per choice (the stream is aborted on the way out)."""
    usage, choices = Usage(), {}
    try:
        prompt_lps = {}  # request id -> its prompt logprobs (in one output)
        async for out in stream:
            usage.add(out)
            if out.prompt_logprobs is not None:
                prompt_lps[out.request_id] = out.prompt_logprobs
            for c in out.outputs:
                i = index_of[out.request_id] + c.index
                choice = choices.get(i) or choices.setdefault(i, Choice(kind, c, out.request_id))
                choice.add(c)
                # one sequence's tokens of one step at a time, between other work (`/health`):
                # an output of n sequences x K steps x top logprobs is tens of milliseconds
                await asyncio.sleep(0)
    finally:
        stream.abort()
    for choice in choices.values():
        choice.prompt_lps = prompt_lps.get(choice.request_id)
    if kind.echo_only:  # the token generated to get there is not part of the answer
        usage.completion = 0
    return choices, usage
