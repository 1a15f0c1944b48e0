"""`AsyncEngine`: an `LLMEngine` on a thread of its own, or in a process of its own, fed and
drained from asyncio.

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

With an `EngineCoreProcess` (what `jaxpaged serve` uses by default) the engine steps in a child
process (`engine/core_process.py`) and the engine thread here becomes the output thread: it
receives each step's deltas, runs the `OutputProcessor` over them (detokenization and stop
strings, off the engine's critical path) and delivers outputs as in step 3; a sender thread
forwards commands (adds, aborts, the stop strings found here, training-loop controls). Adds and
controls are answered by the child, so a bad request still raises its `ValueError` in its
handler. If the child dies, every request in flight gets `EngineDeadError` and `on_dead` runs, as
for a failed step.
"""

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from jaxpaged.engine.core_messages import (
    Abort,
    AddRequests,
    AddResult,
    Control,
    ControlResult,
    CoreFailed,
    CoreReady,
    CoreStep,
    CoreStopped,
    Shutdown,
    StopOnString,
)
from jaxpaged.engine.core_process import EngineCoreProcess
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine.setup import load_tokenizer
from jaxpaged.engine_config import EngineConfig
from jaxpaged.lora_request import LoRARequest
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("jaxpaged.server")


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or a step raised); no request can run."""


class EngineNotReadyError(RuntimeError):
    """The engine is still starting (loading and compiling), or draining for shutdown."""


class EngineOverloadedError(RuntimeError):
    """The server is over capacity (more sequences wait than `max_num_waiting` allows, or the
    grammar checks are busy); retry later."""


class RequestFailedError(RuntimeError):
    """This request failed inside the engine; other requests go on. `error_type`: OpenAI's error
    type, "invalid_request_error" when what the request asked failed (its grammar), else
    "server_error"."""

    def __init__(self, message: str, error_type: str | None = None):
        super().__init__(message)
        self.error_type = error_type or "server_error"


def check_data_parallel_rank(rank: int | None, size: int) -> None:
    """Refuses a replica rank (vLLM's `X-data-parallel-rank` header) a server of `size` replicas
    does not have.

    Raises:
      ValueError: naming the header and the ranks there are.
    """
    if rank is not None and not 0 <= rank < size:
        raise ValueError(
            f"X-data-parallel-rank {rank}: this server runs {size} engine replica(s) (--data-parallel-size "
            f"{size}); send a rank from 0 to {size - 1}, or leave the header out"
        )


def stream_kind(params: SamplingParams) -> SamplingParams:
    """A request's parameters as the engine gets them: its outputs as deltas (a stream: every
    token as it is sampled, no fused decode windows), unless it asks for `FINAL_ONLY` (one output
    when it is done: the server's requests without `stream`, which keep the fused windows)."""
    if params.output_kind is RequestOutputKind.FINAL_ONLY:
        return params
    return dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)


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
      engine: a started engine, or a function that builds one: it is then called on the
        engine thread, so a server can answer (liveness, "starting") while it compiles; or an
        `EngineCoreProcess`, the engine starting in a child process.
      max_num_waiting: sequences that may wait beyond the engine's `max_num_seqs` running
        ones; adding more raises `EngineOverloadedError` (None: no limit).
      on_dead: called once, on the engine thread, if the engine fails (not on shutdown),
        before any request or stream learns of it.

    Attributes:
      engine: the wrapped engine, None while starting or in a child process (do not call it
        from other threads).
      tokenizer_dir: where the server's tokenizers load from (None without a tokenizer).
      stats: the latest `LLMEngine.get_stats()` snapshot.
      output_observers: callables `(output, now)` run on the engine thread for each output
        (metrics); they must be quick and must not raise.
      dead: the error that stopped the engine thread, or None while it runs.
      draining: set by the server on shutdown: no new requests are admitted.
    """

    def __init__(
        self,
        engine: LLMEngine | Callable[[], LLMEngine] | EngineCoreProcess,
        *,
        max_num_waiting: int | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ):
        self.engine: LLMEngine | None = None
        self.config: EngineConfig | None = None  # the engine's, once it is ready
        self.tokenizer_dir = None
        self.max_num_waiting = max_num_waiting
        self.stats: dict[str, Any] = {}
        self.output_observers: list[Callable[[RequestOutput, float], None]] = []
        self.dead: BaseException | None = None
        self.draining = False
        self.ready = threading.Event()
        self._ready_callbacks: list[Callable[[], None]] = []
        self._on_dead = on_dead
        self._cond = threading.Condition()
        self._commands: list[tuple] = []
        self._stopping = False
        self._unfinished_seqs = 0  # added and not finished (guarded by _cond)
        self._seqs_of: dict[str, int] = {}  # engine thread only: request id -> its sequences
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._core = engine if isinstance(engine, EngineCoreProcess) else None
        self._pending: dict[int, tuple] = {}  # core mode: add or control tag -> its command, until answered
        self._tags = itertools.count()
        self._aborted_at_shutdown = 0  # core mode: requests left when the core was told to stop
        if isinstance(engine, LLMEngine):
            self._adopt(engine)
            target, args = self._run, (None,)
        elif self._core is not None:
            target, args = self._run_core, ()
        else:
            target, args = self._run, (engine,)
        self._thread = threading.Thread(target=target, args=args, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    def _adopt(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._become_ready(engine.config, engine.get_stats())

    def _become_ready(self, config, stats: dict[str, Any]) -> None:
        """Records the ready engine's `EngineConfig`, tokenizer directory and stats; runs the
        `when_ready` callbacks; sets `ready`."""
        self.config, self.tokenizer_dir, self.stats = config, config.load.tokenizer, stats
        self.max_num_seqs = config.scheduling.max_num_seqs
        for callback in self._ready_callbacks:
            callback()
        self.ready.set()

    def when_ready(self, callback: Callable[[], None]) -> None:
        """Runs `callback()` once the engine is built: now if it is, else on the engine thread
        before `ready` is set (for set-up that must not run on an event loop)."""
        if self.ready.is_set():
            callback()
        else:
            self._ready_callbacks.append(callback)

    # -- event-loop side ---------------------------------------------------------------------

    async def add_requests(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[Any],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        data_parallel_rank: int | None = None,
    ) -> RequestStream:
        """Adds requests (all or none) and returns the stream of their delta outputs (their final
        outputs only if `params` asks `FINAL_ONLY`: see `stream_kind`).

        Args:
          request_ids: one unique id per prompt.
          prompts: anything `LLMEngine.add_request` takes.
          params: sampling parameters shared by all of them.
          cache_salt: isolates their prefix-cache entries.
          lora_request: the LoRA adapter they run with (None: the base model).
          data_parallel_rank: the replica asked for (vLLM's `X-data-parallel-rank`): 0 or None
            for one engine (`DataParallelEngine` serves more).

        Raises:
          ValueError: from `LLMEngine.add_request` (nothing stays queued then), or a
            `data_parallel_rank` other than 0.
          EngineDeadError: the engine thread has stopped.
          EngineNotReadyError: still starting, or draining.
          EngineOverloadedError: `max_num_waiting` would be exceeded.
        """
        check_data_parallel_rank(data_parallel_rank, 1)
        if self.dead is not None:
            raise EngineDeadError("the engine is not running")
        if self.draining or not self.ready.is_set():
            raise EngineNotReadyError("the server is shutting down" if self.draining else "the engine is starting")
        stream = RequestStream(self, request_ids, asyncio.get_running_loop())
        done: concurrent.futures.Future = concurrent.futures.Future()
        command = ("add", stream, list(prompts), params, cache_salt, lora_request, time.time(), done)
        self._submit(command, len(prompts) * params.n)
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(list(request_ids))  # the add may already have happened
            raise
        return stream

    async def generate(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Adds one request and yields its delta outputs (one output when done if `params` asks
        `FINAL_ONLY`: see `stream_kind`); closing early aborts it.

        Raises:
          ValueError: a bad prompt or parameters (raised at the first iteration).
        """
        stream = await self.add_requests(
            [request_id], [prompt], params, cache_salt=cache_salt, lora_request=lora_request
        )
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

    @property
    def is_ready(self) -> bool:
        """Started, running and not draining: what `/health` (readiness) reports."""
        return self.ready.is_set() and self.dead is None and not self.draining

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the engine thread after its current step: unfinished requests are aborted (their KV
        blocks return to the pool) and their streams get `EngineDeadError`."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._core is not None and not self.ready.is_set():
            self._core.stop(timeout=0.0)  # still starting: nothing to drain
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._core is not None:
            self._core.stop(timeout=0.0 if self._thread.is_alive() else 5.0)

    def _submit(self, command: tuple, num_seqs: int = 0) -> None:
        with self._cond:
            if self.dead is not None:
                raise EngineDeadError("the engine is not running")
            if num_seqs and self.max_num_waiting is not None:
                limit = self.max_num_seqs + self.max_num_waiting
                if self._unfinished_seqs + num_seqs > limit:
                    raise EngineOverloadedError(
                        f"the server is at capacity ({self._unfinished_seqs} sequences running or waiting, at most "
                        f"{limit}); retry later"
                    )
            self._unfinished_seqs += num_seqs
            self._commands.append(command)
            self._cond.notify()

    @property
    def num_unfinished_seqs(self) -> int:
        """Sequences added and not yet finished (running, waiting, or about to be added)."""
        return self._unfinished_seqs

    def _finished_seqs(self, n: int) -> None:
        with self._cond:
            self._unfinished_seqs -= n

    # -- engine thread -----------------------------------------------------------------------

    def _run(self, factory: Callable[[], LLMEngine] | None) -> None:
        if factory is not None:
            try:
                self._adopt(factory())
            except BaseException as err:  # start-up failed: nothing can be served
                logger.exception("the engine failed to start")
                self._die(EngineDeadError(f"the engine failed to start: {type(err).__name__}"), fatal=True)
                return
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
            logger.exception("the engine loop failed; every request in flight fails and no new one is accepted")
            self._die(EngineDeadError(f"the engine loop failed ({type(err).__name__})"), fatal=True)
            return
        self._abort_all()
        self.engine.shutdown()  # releases the follower processes of a multi-process engine
        self._die(EngineDeadError("the engine was shut down"), fatal=False)

    # -- engine-core process: the output thread and the sender thread ------------------------

    def _run_core(self) -> None:
        """Core mode's engine thread: waits for the child to be ready, then turns each step's
        deltas into outputs until the child stops or dies."""
        try:
            ready: CoreReady = self._core.wait_ready()
            tokenizer_dir = ready.config.load.tokenizer
            tokenizer = None if tokenizer_dir is None else load_tokenizer(tokenizer_dir)
        except (EOFError, OSError):  # it died, or was stopped by `shutdown` while starting
            self._die(EngineDeadError(f"the engine failed to start: {self._core.died()}"), fatal=not self._stopping)
            return
        except BaseException as err:  # the child's start-up error, the same exception
            logger.error("the engine failed to start", exc_info=err)
            self._die(EngineDeadError(f"the engine failed to start: {type(err).__name__}"), fatal=True)
            return
        self._outputs = OutputProcessor(tokenizer, self._stop_on_string, lambda request_id: self.abort(request_id))
        self._become_ready(ready.config, ready.stats)
        threading.Thread(target=self._forward_commands, name="jaxpaged-engine-sender", daemon=True).start()
        try:
            while True:
                message = self._core.recv()
                if isinstance(message, CoreStopped):
                    break
                if isinstance(message, CoreFailed):
                    raise message.error
                self._take_step(message)
        except (EOFError, OSError):
            err = EngineDeadError(self._core.died())
            logger.error("%s; every request in flight fails and no new one is accepted", err)
            self._die(err, fatal=True)
            return
        except BaseException as err:
            logger.error("the engine loop failed; every request in flight fails", exc_info=err)
            self._die(EngineDeadError(f"the engine loop failed ({type(err).__name__})"), fatal=True)
            return
        self._log_stopped(message.stats, self._aborted_at_shutdown)
        self._die(EngineDeadError("the engine was shut down"), fatal=False)

    def _take_step(self, step: CoreStep) -> None:
        for answer in step.answers:
            if isinstance(answer, ControlResult):
                self._answer_control(answer)
            else:
                self._answer_add(answer)
        self._outputs.process(step.deltas)
        self.stats = step.stats
        self._deliver(self._outputs.outputs())

    def _answer_add(self, result: AddResult) -> None:
        with self._cond:
            _, stream, _, params, _, _, arrival, done = self._pending.pop(result.tag)
        if result.error is not None:
            self._finished_seqs(len(stream.request_ids) * params.n)
            done.set_exception(result.error)
            return
        for request_id, prompt, prompt_token_ids, resolved in result.accepted:
            self._outputs.add_request(request_id, prompt, prompt_token_ids, resolved, arrival)
            self._streams[request_id] = stream
            self._seqs_of[request_id] = params.n
        done.set_result(None)

    def _answer_control(self, answer: ControlResult) -> None:
        with self._cond:
            _, _, done = self._pending.pop(answer.tag)
        _settle(done, answer)

    def _stop_on_string(self, request_id: str, index: int, num_output_tokens: int, stop: str) -> None:
        with self._cond:
            self._commands.append(("stop", StopOnString(request_id, index, num_output_tokens, stop)))
            self._cond.notify_all()

    def _forward_commands(self) -> None:
        """Core mode's sender thread: sends commands to the child (never blocking an event loop or
        the output thread on the pipe); at shutdown, asks the child to stop."""
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for command in commands:
                    message = self._core_message(command)
                    if message is not None:
                        self._core.send(message)
                if stopping:
                    self._aborted_at_shutdown = len(self._streams)  # the core aborts what is left
                    self._core.send(Shutdown())
                    return
        except OSError:  # the child is gone; the output thread reports it
            pass

    def _core_message(self, command: tuple):
        kind = command[0]
        if kind == "stop":
            return command[1]
        if kind == "abort":
            return Abort([command[1]] if isinstance(command[1], str) else list(command[1]))
        if kind == "abort_all":
            return Abort(None)
        if kind == "control":
            _, control, done = command
            if not done.set_running_or_notify_cancel():
                return None  # the caller went away first
            with self._cond:
                self._pending[control.tag] = command
            return control
        _, stream, prompts, params, cache_salt, lora, arrival, done = command
        if not done.set_running_or_notify_cancel():
            self._finished_seqs(len(stream.request_ids) * params.n)
            return None  # the caller went away before the request was added
        tag = next(self._tags)
        with self._cond:
            self._pending[tag] = command
        params = stream_kind(params)
        return AddRequests(tag, stream.request_ids, prompts, params, cache_salt, arrival, lora)

    # -- shutdown ----------------------------------------------------------------------------

    def _abort_all(self) -> None:
        """At shutdown: aborts what is left so every KV block returns to the pool."""
        unfinished = list(self._streams)
        if unfinished:
            self.engine.abort_request(unfinished)
            self._deliver(self.engine.step())
        self._log_stopped(self.engine.get_stats(), len(unfinished))

    @staticmethod
    def _log_stopped(stats: dict[str, Any], num_aborted: int) -> None:
        logger.info(
            "engine stopped: %d request(s) aborted at shutdown; %d of %d KV blocks free",
            num_aborted,
            stats["num_free_blocks"],
            stats["num_total_blocks"],
        )

    def abort_all(self) -> None:
        """Aborts every request in flight (thread-safe): their streams end with finish_reason
        "abort" and their KV blocks return to the pool."""
        try:
            self._submit(("abort_all",))
        except EngineDeadError:
            pass

    def control(self, method: str, *args) -> concurrent.futures.Future:
        """Calls one of the engine's training-loop methods (`core_messages.CONTROL_METHODS`:
        `sleep`, `wake_up`, `is_sleeping`, `reset_prefix_cache`, `pause_generation`,
        `resume_generation`, `is_paused`) between two steps, on the engine thread or in the
        engine-core process; the future gets its result or the error it raised (the engine goes
        on).

        Raises:
          ValueError: `method` is not a control method.
          EngineDeadError: the engine has stopped.
        """
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("control", Control(next(self._tags), method, args), done))
        return done

    def _apply(self, command: tuple) -> None:
        if command[0] == "control":
            _, control, done = command
            if done.set_running_or_notify_cancel():  # else the caller went away first
                _settle(done, control.run(self.engine))
            return
        if command[0] == "abort":
            self.engine.abort_request(command[1])
            return
        if command[0] == "abort_all":
            self.engine.abort_request(list(self._streams))
            return
        _, stream, prompts, params, cache_salt, lora, arrival, done = command
        if not done.set_running_or_notify_cancel():
            self._finished_seqs(len(stream.request_ids) * params.n)
            return  # the caller went away before the request was added
        added = []
        try:
            params = stream_kind(params)
            for request_id, prompt in zip(stream.request_ids, prompts, strict=True):
                self.engine.add_request(
                    request_id, prompt, params, arrival_time=arrival, cache_salt=cache_salt, lora_request=lora
                )
                added.append(request_id)
        except Exception as err:  # the caller's error (a ValueError, usually): hand it back
            if added:  # their outputs come with the next step, to no stream
                self.engine.abort_request(added)
            self._finished_seqs(len(stream.request_ids) * params.n)
            done.set_exception(err)
            return
        for request_id in added:
            self._streams[request_id] = stream
            self._seqs_of[request_id] = params.n
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
            if output.finished:
                self._finished_seqs(self._seqs_of.pop(output.request_id, 0))
            if stream is not None:
                item = RequestFailedError(output.error, output.error_type) if output.error else output
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            _call_soon(loop, _put_all, items)

    def _die(self, err: EngineDeadError, fatal: bool) -> None:
        with self._cond:
            self.dead = err
            self._unfinished_seqs = 0
            commands, self._commands = self._commands, []
            pending, self._pending = list(self._pending.values()), {}
        if fatal and self._on_dead is not None:
            self._on_dead(err)  # first: a client that sees the death knows the server has been told
        for command in commands + pending:
            if command[0] in ("add", "control") and (
                command[-1].running() or command[-1].set_running_or_notify_cancel()
            ):
                command[-1].set_exception(err)
        streams, self._streams = self._streams, {}
        for stream in set(streams.values()):
            _call_soon(stream.loop, _put_all, [(stream, err)])


def _settle(done: concurrent.futures.Future, answer: ControlResult) -> None:
    if answer.error is None:
        done.set_result(answer.result)
    else:
        done.set_exception(answer.error)


def _put_all(items: list) -> None:
    for stream, item in items:
        stream.put(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop has closed; nobody is listening
        pass
