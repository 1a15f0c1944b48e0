"""The client connection: a streamed response's server-sent events (`sse_events`, sent by
`EventStreamResponse`, which stops when the client goes away) and `run_until_disconnect` for a
non-streamed one.
"""

import asyncio
import json
import logging

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse

from jaxpaged.server.async_engine import EngineDeadError, RequestFailedError, RequestStream
from jaxpaged.server.protocol import error_body
from jaxpaged.server.responses import Kind, Usage

logger = logging.getLogger("jaxpaged.server")


async def sse_events(
    stream: RequestStream,
    kind: Kind,
    head: dict,
    index_of: dict,
    num_choices: int,
    usage: Usage,
    include_usage: bool,
    continuous_usage: bool,
):
    """A streamed response's SSE lines: chat's role chunks, a chunk per choice per output (echo's
    prompt first; with tools, the parser's deltas), the usage when asked (in every chunk too, so
    far, with `continuous_usage`: `usage` knows the prompts' lengths), then `[DONE]`; an engine
    failure is an error event. The stream is aborted on the way out."""
    done, offsets, tool_streams = set(), {}, {}

    def usage_now() -> dict:
        if kind.echo_only:  # the token generated to get there is not part of the answer
            usage.completion = 0
        return usage.to_dict()

    def chunk(choice: dict) -> str:
        extra = {"usage": usage_now() if continuous_usage else None} if include_usage else {}
        return _sse({**head, "choices": [choice], **extra})

    try:
        if kind.chat:
            for i in range(num_choices):
                delta = {"role": "assistant", "content": ""}
                yield chunk({"index": i, "delta": delta, "logprobs": None, "finish_reason": None, "stop_reason": None})
        prompt_lps, held = {}, {}  # echo: request id -> prompt logprobs; choice -> output held for them
        async for out in stream:
            usage.add(out)
            if out.prompt_logprobs is not None:
                prompt_lps[out.request_id] = out.prompt_logprobs
            for c in out.outputs:
                i = index_of[out.request_id] + c.index
                if i in done or not (c.text or c.token_ids or c.finish_reason):
                    continue
                text, ids, lps, first = c.text, c.token_ids, c.logprobs, ""
                if kind.echo is not None and i not in offsets:  # the prompt goes first, once
                    pending = held.pop(i, None)
                    if pending is not None:  # what came while its prompt logprobs had not
                        text, ids = pending[0] + text, pending[1] + ids
                        lps = None if lps is None else pending[2] + lps
                    if kind.num_logprobs is not None and out.request_id not in prompt_lps:
                        held[i] = (text, ids, list(lps or []))  # a sibling computes them: wait for it
                        continue
                    text, ids, lps, first = kind.echoed(
                        kind.prompt_of[out.request_id], text, ids, lps, prompt_lps.get(out.request_id)
                    )
                elif kind.echo_only:
                    text, ids, lps = "", [], []
                if c.finish_reason:
                    done.add(i)
                if kind.tools is not None:
                    stream_i = tool_streams.setdefault(i, kind.tools.stream())
                    for choice in kind.tool_chunks(i, c, stream_i):
                        yield chunk(choice)
                    continue
                offset = offsets.get(i, 0)
                choice = kind.choice(i, text, ids, lps, c, chunk=True, offset=offset, first_text=first)
                offsets[i] = offset + len(text)
                yield chunk(choice)
        if include_usage:
            yield _sse({**head, "choices": [], "usage": usage_now()})
        logger.info("%s: finished, %d completion tokens", head["id"], usage.completion)
        yield "data: [DONE]\n\n"
    except (EngineDeadError, RequestFailedError) as err:
        yield _sse(error_body(str(err), getattr(err, "error_type", "server_error")))
        yield "data: [DONE]\n\n"
    finally:
        stream.abort()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop, and call `on_close`, as soon as the client goes away.

    Starlette only watches for a disconnect under ASGI < 2.4; this watches always, so a
    request is aborted even before its first token. A client that stops reading (its socket's
    buffers full) for `write_timeout` seconds is treated as gone: output never piles up
    unbounded behind a reader that does not read.
    """

    def __init__(self, content, on_close, write_timeout: float):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._content, self._on_close, self._write_timeout = content, on_close, write_timeout

    def mapped(self, transform) -> "EventStreamResponse":
        """The same stream with its events rewritten: `transform(events)` is an async iterator of
        the new events (e.g. the Responses API's from chat chunks)."""
        return EventStreamResponse(transform(self._content), self._on_close, self._write_timeout)

    async def __call__(self, scope, receive, send) -> None:
        async def send_in_time(message) -> None:
            with anyio.fail_after(self._write_timeout):  # TimeoutError: an OSError, handled below
                await send(message)

        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send_in_time)
                    except OSError:  # the client went away mid-send, or stopped reading
                        pass
                    finally:
                        group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self._on_close()
            await self.body_iterator.aclose()


async def run_until_disconnect(raw: Request, coro):
    """Awaits `coro`, unless the client disconnects first: then cancels it and returns None."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None
