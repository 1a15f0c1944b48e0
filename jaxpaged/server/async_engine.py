"""`AsyncEngine`: an `LLMEngine` on a thread of its own, fed and drained from asyncio.

How a request flows:
  1. A handler awaits `add_requests(...)` (or iterates `generate(...)`). The request joins a
     locked command list and wakes the engine thread, which calls `LLMEngine.add_request`
     between two steps and answers through a future: a bad request raises its `ValueError`
     in the handler (a 400), never in the loop.
  2. The engine thread steps while anything is unfinished and sleeps on a condition when idle.
  3. After each step the delta `RequestOutput`s go to their requests' `asyncio.Queue`s, with
     one `loop.call_soon_threadsafe` per event loop per step.
  4. The handler iterates its `RequestStream`. Leaving early (client disconnect, cancellation,
     an error) calls `abort()`, so the engine frees the blocks at the next step boundary.

The engine is not thread-safe: only the engine thread ever calls into it. Everything else
reads `stats`, a snapshot of `LLMEngine.get_stats()` taken after every step.
"""

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from jaxpaged.engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxpaged.server")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or a step raised); no request can run."""


class RequestStream:
    """The delta outputs of requests added together, as an async iterator, in arrival order.

    Iteration ends when every request has finished; it raises `EngineDeadError` if the engine
    dies first. Call `abort()` when leaving early (it is a no-op once all have finished).
    """

    def __init__(self, engine: "AsyncEngine", request_ids: Sequence[str], loop: asyncio.AbstractEventLoop):
        self.request_ids = list(request_ids)
        self.loop = loop
        self._engine = engine
        self._unfinished = set(self.request_ids)
        self._queue: asyncio.Queue = asyncio.Queue()

    @property
    def finished(self) -> bool:
        """All requests finished, were aborted, or the engine died."""
        return not self._unfinished

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queues an output or an error (event-loop thread only)."""
        self._queue.put_nowait(item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    def abort(self) -> None:
        """Aborts the requests that have not finished; safe to call more than once."""
        if self._unfinished:
            ids, self._unfinished = sorted(self._unfinished), set()
            self._engine.abort(ids)


class AsyncEngine:
    """Runs an `LLMEngine` on a background thread for asyncio callers (the OpenAI server).

    Args:
      engine: a started engine; from now on only this object's thread may call it.

    Attributes:
      engine: the wrapped engine (do not call it from other threads).
      tokenizer: a tokenizer of the event loop's own (the engine thread uses the engine's).
      stats: the latest `LLMEngine.get_stats()` snapshot.
      output_observers: callables `(output, now)` run on the engine thread for each output
        (metrics); they must be quick and must not raise.
      dead: the error that stopped the engine thread, or None while it runs.
    """

    def __init__(self, engine: LLMEngine):
        from transformers import AutoTokenizer

        self.engine = engine
        self.tokenizer = AutoTokenizer.from_pretrained(engine.args.tokenizer or engine.args.model)
        self.model_config = engine.model_config
        self.max_model_len = engine.max_model_len
        self.stats: dict[str, Any] = engine.get_stats()
        self.output_observers: list[Callable[[RequestOutput, float], None]] = []
        self.dead: BaseException | None = None
        self._cond = threading.Condition()
        self._commands: list[tuple] = []
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncEngine":
        """Builds (and compiles) the engine, then starts its thread."""
        return cls(LLMEngine(args))

    # -- event-loop side ---------------------------------------------------------------------

    async def add_requests(self, request_ids: Sequence[str], prompts: Sequence[Any], params: SamplingParams, *,
                           cache_salt: str | None = None) -> RequestStream:  # fmt: skip
        """Adds requests (all or none) and returns the stream of their delta outputs.

        Args:
          request_ids: one unique id per prompt.
          prompts: anything `LLMEngine.add_request` takes.
          params: sampling parameters shared by all of them.
          cache_salt: isolates their prefix-cache entries.

        Raises:
          ValueError: from `LLMEngine.add_request` (nothing stays queued then).
          EngineDeadError: the engine thread has stopped.
        """
        stream = RequestStream(self, request_ids, asyncio.get_running_loop())
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("add", stream, list(prompts), params, cache_salt, time.time(), done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(list(request_ids))  # the add may already have happened
            raise
        return stream

    async def generate(self, prompt: Any, params: SamplingParams, request_id: str,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """Adds one request and yields its delta outputs; closing early aborts it.

        Raises:
          ValueError: a bad prompt or parameters (raised at the first iteration).
        """
        stream = await self.add_requests([request_id], [prompt], params, cache_salt=cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    def abort(self, request_id: str | list[str]) -> None:
        """Aborts requests (thread-safe, returns at once; unknown or finished ids are ignored)."""
        try:
            self._submit(("abort", request_id))
        except EngineDeadError:
            pass

    @property
    def is_running(self) -> bool:
        """False once the engine thread has stopped (see `dead`)."""
        return self.dead is None

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the engine thread after its current step; open streams get `EngineDeadError`."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _submit(self, command: tuple) -> None:
        with self._cond:
            if self.dead is not None:
                raise EngineDeadError(f"the engine is not running ({self.dead})")
            self._commands.append(command)
            self._cond.notify()

    # -- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        busy = False
        try:
            while True:
                with self._cond:
                    while not (self._commands or busy or self._stopping):
                        self._cond.wait()
                    if self._stopping:
                        break
                    commands, self._commands = self._commands, []
                for command in commands:
                    self._apply(command)
                outputs = self.engine.step()  # also delivers aborts when nothing else runs
                self.stats = self.engine.get_stats()
                busy = self.engine.has_unfinished_requests()
                self._deliver(outputs)
        except BaseException as err:  # a step failed: the engine's state is unknown, stop serving
            logger.exception("the engine loop failed; no further requests will run")
            self._die(EngineDeadError(f"the engine loop failed: {type(err).__name__}: {err}"))
            return
        self._die(EngineDeadError("the engine was shut down"))

    def _apply(self, command: tuple) -> None:
        if command[0] == "abort":
            self.engine.abort_request(command[1])
            return
        _, stream, prompts, params, cache_salt, arrival, done = command
        if not done.set_running_or_notify_cancel():
            return  # the caller went away before the request was added
        added = []
        try:
            params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)  # streams carry deltas
            for request_id, prompt in zip(stream.request_ids, prompts, strict=True):
                self.engine.add_request(request_id, prompt, params, arrival_time=arrival, cache_salt=cache_salt)
                added.append(request_id)
        except Exception as err:  # the caller's error (a ValueError, usually): hand it back
            if added:
                self.engine.abort_request(added)
            done.set_exception(err)
            return
        for request_id in added:
            self._streams[request_id] = stream
        done.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        now = time.time()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for output in outputs:
            for observe in self.output_observers:
                try:
                    observe(output, now)
                except Exception:
                    logger.exception("output observer failed")
            get = self._streams.pop if output.finished else self._streams.get
            stream = get(output.request_id, None)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _die(self, err: EngineDeadError) -> None:
        with self._cond:
            self.dead = err
            commands, self._commands = self._commands, []
        for command in commands:
            if command[0] == "add" and command[-1].set_running_or_notify_cancel():
                command[-1].set_exception(err)
        streams, self._streams = self._streams, {}
        for stream in set(streams.values()):
            _call_soon(stream.loop, _put_all, [(stream, err)])


def _put_all(items: list) -> None:
    for stream, item in items:
        stream.put(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop has closed; nobody is listening
        pass
