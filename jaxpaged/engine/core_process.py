"""The engine core in a child process: the server's half and the child's loop.

Output processing (detokenization, stop strings, `RequestOutput`s) is a large part of a step's
host work; on the engine's thread it delays the next dispatch, and on a second thread of the same
process it would still take the GIL from the engine every step. So `jaxpaged serve` runs the
`LLMEngine` in a child process (vLLM V1's engine core) and processes outputs in the server:

  1. `EngineCoreProcess(args)` spawns the child (a fresh interpreter: JAX, the model, compiling).
     The child first checks that its devices and memory fit the engine and answers `CoreChecked`
     (only the child touches the devices: JAX in the server's process would take GPU memory the
     engine needs), then builds the engine and answers `CoreReady`; or `CoreFailed` with the
     start-up error itself (an `EngineArgsError` naming its field arrives as one).
  2. The child's loop: read every pending command (add, abort, stop-on-string, a training-loop
     control such as sleep or pause, shutdown), run one `LLMEngine.step_deltas()`, send one
     `CoreStep` (the adds' and controls' answers, the deltas, the stats); when idle, block on the
     pipe. A control's error is its answer: the engine goes on.
  3. The server (`server/async_engine.py`) turns deltas into outputs with the `OutputProcessor`
     and sends `StopOnString` back when it finds a stop string.
  4. `Shutdown` aborts what is left, steps until idle and exits. The child ignores SIGINT and
     SIGTERM (the server drains on them, then shuts the core down), and exits when the server's
     end of the pipe closes (the server died).
"""

import atexit
import gc
import logging
import multiprocessing
import pickle
import signal
import time
from collections.abc import Callable

from jaxpaged.engine.core_messages import (
    Abort,
    AddRequests,
    AddResult,
    Control,
    ControlResult,
    CoreChecked,
    CoreFailed,
    CoreReady,
    CoreStep,
    CoreStopped,
    Shutdown,
    StopOnString,
)
from jaxpaged.engine_args import EngineArgs
from jaxpaged.engine_config import EngineConfig
from jaxpaged.parallel.replicas import check_replica_platform, restrict_to_replica_gpus

logger = logging.getLogger("jaxpaged")

# Steps the core may take after `Shutdown` to deliver its aborts (the step in flight, then one).
SHUTDOWN_STEPS = 4


# How long the owner waits for a killed child to be gone before going on without it.
KILL_WAIT_SECONDS = 5.0


class EngineCoreProcess:
    """The server's handle on an engine core running in a child process.

    Args:
      args: the engine's configuration as the server resolved it (the child uses it as it is),
        or its options (the child resolves them against the model).
      on_ready: called in the child as `on_ready(engine, seconds)` once the engine is built (the
        server logs what it sized and compiled); a module-level function (it is pickled).

    The pipe is used by one sender and one receiver thread at a time (`send` and `recv`).
    """

    def __init__(self, args: EngineArgs | EngineConfig, on_ready: Callable | None = None):
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        level = logging.getLogger("jaxpaged").getEffectiveLevel()
        self.process = context.Process(
            target=run_engine_core,
            args=(args, child_conn, level, on_ready),
            name="jaxpaged-engine-core",
            daemon=True,
        )
        # The child ignores SIGTERM, and multiprocessing's exit handler terminates daemonic children
        # and joins them: it would wait forever whenever this object's owner never reached `stop`
        # (e.g. Ctrl-C inside this constructor). Handlers run last-registered first: this one first.
        atexit.register(self._kill)
        self.process.start()
        child_conn.close()  # the child's end lives in the child only: its death closes the pipe
        self._checked = False

    def wait_checked(self) -> None:
        """Waits until the child has checked its devices and memory (seconds: JAX's import);
        raises the check's error (the same exception), e.g. too few devices."""
        if not self._checked:
            message = self.recv()
            if isinstance(message, CoreFailed):
                raise message.error
            self._checked = True

    def wait_ready(self) -> CoreReady:
        """Waits for the engine to be built; raises its start-up error (the same exception)."""
        self.wait_checked()
        message = self.recv()
        if isinstance(message, CoreFailed):
            raise message.error
        return message

    def send(self, message) -> None:
        """Sends a command (raises `OSError` once the child is gone)."""
        self._conn.send(message)

    def recv(self):
        """The child's next message; raises `EOFError` once it has died."""
        return self._conn.recv()

    def _kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join(KILL_WAIT_SECONDS)

    def stop(self, timeout: float) -> None:
        """Waits up to `timeout` seconds for the child to exit, then kills it (and waits at most
        `KILL_WAIT_SECONDS` more for it to go: a process in uninterruptible sleep dies only when
        it leaves it, and the server's exit must not wait on that)."""
        self.process.join(timeout)
        self._kill()
        self._conn.close()

    def died(self) -> str:
        """Why the child is gone, for errors and logs."""
        self.process.join(5)
        return f"the engine process died (exit code {self.process.exitcode})"


def run_engine_core(args: EngineArgs | EngineConfig, conn, log_level: int, on_ready: Callable | None) -> None:
    """The child's main function: builds the engine and serves commands until `Shutdown` or the
    server's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains on these, then shuts us down
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxpaged").setLevel(log_level)
    start = time.perf_counter()
    try:
        config = args if isinstance(args, EngineConfig) else EngineConfig.resolve(args)
        replicas = config.parallel.data_parallel_size
        if replicas > 1:  # before JAX loads: this replica's process sees its own GPUs only
            devices = config.layout.size * config.layout.pipeline.size
            restrict_to_replica_gpus(config.parallel.data_parallel_rank, devices, replicas)
        from jaxpaged.engine.llm_engine import LLMEngine  # JAX loads here, in the child only
        from jaxpaged.engine.setup import check_engine_fits

        check_engine_fits(config)
        if replicas > 1:
            import jax

            check_replica_platform(config.parallel.data_parallel_rank, replicas, jax.default_backend())
    except BaseException as err:
        conn.send(CoreFailed(_picklable(err), starting=True))
        return
    conn.send(CoreChecked())
    try:
        engine = LLMEngine(config)
        if on_ready is not None:
            on_ready(engine, time.perf_counter() - start)
    except BaseException as err:
        conn.send(CoreFailed(_picklable(err), starting=True))
        return
    # Everything alive now (JAX, the model, compiled programs) lives as long as the process: the
    # GC's full collections need not walk it every time requests' objects trigger one (vLLM's
    # engine core does the same).
    gc.collect()
    gc.freeze()
    conn.send(CoreReady(engine.config, engine.get_stats()))
    try:
        _serve(engine, conn)
    except (EOFError, OSError):  # the server is gone
        pass
    except BaseException as err:
        logger.exception("the engine core failed")
        conn.send(CoreFailed(_picklable(err), starting=False))
    finally:
        engine.shutdown()


def _serve(engine, conn) -> None:
    while True:
        if not engine.has_unfinished_requests():
            conn.poll(None)  # idle: sleep until a command comes (or the pipe closes)
        answers = []
        while conn.poll(0):
            command = conn.recv()
            if isinstance(command, Shutdown):
                _drain(engine, conn, answers)
                return
            answer = _apply(engine, command)
            if answer is not None:
                answers.append(answer)
        deltas = engine.step_deltas() if engine.has_unfinished_requests() else []
        conn.send(CoreStep(answers, deltas, engine.get_stats()))


def _apply(engine, command) -> AddResult | ControlResult | None:
    if isinstance(command, StopOnString):
        engine.stop_on_string(command.request_id, command.index, command.num_output_tokens, command.stop)
    elif isinstance(command, Abort):
        engine.abort_request(engine.unfinished_request_ids() if command.request_ids is None else command.request_ids)
    elif isinstance(command, AddRequests):
        return _add(engine, command)
    elif isinstance(command, Control):
        answer = command.run(engine)
        return answer if answer.error is None else ControlResult(answer.tag, None, _picklable(answer.error))
    else:
        raise TypeError(f"unknown engine-core command {command!r}")
    return None


def _add(engine, command: AddRequests) -> AddResult:
    accepted = []
    try:
        for request_id, prompt in zip(command.request_ids, command.prompts, strict=True):
            resolved = engine.add_sequences(
                request_id,
                prompt,
                command.params,
                arrival_time=command.arrival_time,
                cache_salt=command.cache_salt,
                lora_request=command.lora_request,
            )
            accepted.append((request_id, *resolved))
    except Exception as err:  # the caller's error (a ValueError, usually): hand it back
        if accepted:  # their abort deltas reach no request on the server
            engine.abort_request([a[0] for a in accepted])
        return AddResult(command.tag, [], _picklable(err))
    return AddResult(command.tag, accepted)


def _drain(engine, conn, answers: list[AddResult | ControlResult]) -> None:
    """At shutdown: aborts what is left (every KV block returns), sends the last deltas."""
    engine.abort_request(engine.unfinished_request_ids())
    for _ in range(SHUTDOWN_STEPS):
        if not engine.has_unfinished_requests():
            break
        conn.send(CoreStep(answers, engine.step_deltas(), engine.get_stats()))
        answers = []
    conn.send(CoreStep(answers, [], engine.get_stats()))
    conn.send(CoreStopped(engine.get_stats()))


def _picklable(err: BaseException) -> BaseException:
    """`err` itself if it survives pickling (the server re-raises it), else a RuntimeError with
    its type and message."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")
