"""`DataParallelEngine`: `--data-parallel-size` engine replicas behind one API server.

Each replica is an `AsyncEngine` over an engine core in a process of its own
(`EngineCoreProcess`, on its own devices: `parallel/replicas.py`), built by `start_replica(rank)`.
The server talks to a `DataParallelEngine` as to one `AsyncEngine`:

- **Balancing.** Each request (with its `n` samples, and the other prompts of its batch) goes to
  the live replica with the lowest load, vLLM's measure: 4 x waiting + running sequences, counted
  when the server adds them (not a step later), then the KV cache's usage, then the lowest rank.
- **Aborts and controls** (sleep, pause, LoRA adapters, profiling, ...) go to every live
  replica; a control's answer is the first replica's (every replica's error is raised if any
  fails). Loading or removing an adapter is remembered and replayed on a restarted replica.
- **A replica's death** fails only the requests it had streamed tokens for (`EngineDeadError`);
  those that had not streamed anything (running, waiting, or still being added there) are added
  again on another replica and go on as if nothing happened. The dead replica's process is started again and rejoins when it is ready.
  A replica that cannot start with the others fails the server (`on_dead` runs: the server exits 1
  for its supervisor, as with one engine); one that cannot start again is left out, and when none
  is left `on_dead` runs.
- **Stats** are the replicas' summed (the KV cache's usage recomputed from the summed blocks), so
  `/metrics` reports the whole server.
"""

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from jaxpaged.engine.core_process import EngineCoreProcess
from jaxpaged.engine_config import EngineConfig
from jaxpaged.lora_request import LoRARequest
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    check_data_parallel_rank,
)

logger = logging.getLogger("jaxpaged.server")

# Controls whose effect a restarted replica must get again (the adapters loaded at run time).
REPLAYED_CONTROLS = ("add_lora", "remove_lora")


class DataParallelEngine:
    """`size` engine replicas behaving as one `AsyncEngine` (see the module's docstring).

    Args:
      start_replica: `start_replica(rank, on_dead)` builds replica `rank`'s `AsyncEngine`
        (starting), passing `on_dead` on to it.
      size: how many replicas.
      on_dead: called once when no replica is left running (not on shutdown).

    Attributes:
      replicas: the current `AsyncEngine` of each rank.
      config: replica 0's `EngineConfig`, once every replica is ready.
      stats: the replicas' summed stats.
    """

    def __init__(
        self,
        start_replica: Callable[[int, Callable[[BaseException], None]], AsyncEngine],
        size: int,
        *,
        on_dead: Callable[[BaseException], None] | None = None,
    ):
        self.config = None
        self.tokenizer_dir = None
        self.output_observers: list[Callable[[RequestOutput, float], None]] = []
        self.dead: BaseException | None = None
        self.draining = False
        self.ready = threading.Event()
        self._start_replica = start_replica
        self._on_dead = on_dead
        self._lock = threading.Lock()
        self._stopping = False
        self._restarting: set[int] = set()
        self._replayed: list[tuple[str, tuple]] = []  # controls a restarted replica gets again
        self._ready_callbacks: list[Callable[[], None]] = []
        self._waiting_for = size  # replicas not ready yet at start-up
        self.replicas: list[AsyncEngine] = []
        for rank in range(size):
            self.replicas.append(self._start(rank))

    def _start(self, rank: int) -> AsyncEngine:
        started: list[AsyncEngine] = []  # the replica, once built (it may die while being built)
        replica = self._start_replica(rank, lambda err: self._replica_died(rank, started, err))
        started.append(replica)
        replica.output_observers = self.output_observers  # one list: observers added later reach all
        replica.when_ready(lambda: self._replica_ready(rank, replica))
        return replica

    # -- start-up ----------------------------------------------------------------------------

    def _replica_ready(self, rank: int, replica: AsyncEngine) -> None:
        """On the replica's thread, before its `ready` is set."""
        with self._lock:
            restarted = rank in self._restarting
            if not restarted:
                self._waiting_for -= 1
                everyone = self._waiting_for == 0
                if rank == 0:
                    self.config, self.tokenizer_dir = replica.config, replica.tokenizer_dir
        if restarted:
            threading.Thread(target=self._rejoin, args=(rank, replica), daemon=True).start()
            return
        if everyone:
            self.max_num_seqs = replica.max_num_seqs * self.config.parallel.data_parallel_size
            for callback in self._ready_callbacks:
                callback()
            self.ready.set()

    def when_ready(self, callback: Callable[[], None]) -> None:
        """Runs `callback()` once every replica is built (now if they are)."""
        if self.ready.is_set():
            callback()
        else:
            self._ready_callbacks.append(callback)

    # -- requests ----------------------------------------------------------------------------

    def _live(self, exclude: AsyncEngine | None = None) -> list[AsyncEngine]:
        with self._lock:
            restarting = set(self._restarting)
        return [
            r
            for rank, r in enumerate(self.replicas)
            if r is not exclude and rank not in restarting and r.is_running and r.ready.is_set()
        ]

    def choose(self, exclude: AsyncEngine | None = None) -> AsyncEngine:
        """The least loaded live replica (see the module's docstring).

        Raises:
          EngineDeadError: none is running.
        """
        live = self._live(exclude)
        if not live:
            raise EngineDeadError("no engine replica is running")
        return min(live, key=_load)

    async def add_requests(
        self,
        request_ids: Sequence[str],
        prompts: Sequence[Any],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        data_parallel_rank: int | None = None,
    ) -> "ReplicaStream":
        """`AsyncEngine.add_requests` on replica `data_parallel_rank` if given (vLLM's
        `X-data-parallel-rank`: a router that knows where a prefix lives), else on the least
        loaded one; the stream moves to another replica if its own dies before streaming anything.

        Raises:
          ValueError: a rank the server lacks, or the request's own error.
          EngineNotReadyError: starting, draining, or the replica asked for is starting again.
        """
        check_data_parallel_rank(data_parallel_rank, len(self.replicas))
        if self.dead is not None:
            raise EngineDeadError("the engine is not running")
        if self.draining or not self.ready.is_set():
            raise EngineNotReadyError("the server is shutting down" if self.draining else "the engine is starting")
        request = (list(request_ids), list(prompts), params, cache_salt, lora_request)
        if data_parallel_rank is None:
            replica = self.choose()
        elif self.replicas[data_parallel_rank] in self._live():
            replica = self.replicas[data_parallel_rank]
        else:
            raise EngineNotReadyError(f"engine replica {data_parallel_rank} is starting again; retry shortly")
        replica, stream = await self.add_to_live(replica, request)
        return ReplicaStream(self, replica, stream, request)

    async def add_to_live(self, replica: AsyncEngine, request: tuple) -> tuple[AsyncEngine, Any]:
        """`request` (ids, prompts, params, salt, adapter) added on `replica`, or on another live
        replica if that one dies before answering; the replica that took it, and its stream.

        Raises:
          EngineDeadError: no replica is left to take it.
        """
        for _ in range(len(self.replicas)):
            try:
                return replica, await _add(replica, request)
            except EngineDeadError:
                logger.info("requests %s go to another replica (theirs died while adding them)", request[0])
                replica = self.choose(exclude=replica)
        raise EngineDeadError("every engine replica died while the requests were added")

    generate = AsyncEngine.generate  # one request through `add_requests` (it uses nothing else)

    def abort(self, request_id: str | list[str]) -> None:
        """Aborts requests on every replica (unknown ids are ignored there)."""
        for replica in self.replicas:
            replica.abort(request_id)

    def abort_all(self) -> None:
        """Aborts every request in flight on every replica."""
        for replica in self.replicas:
            replica.abort_all()

    def control(self, method: str, *args) -> concurrent.futures.Future:
        """`AsyncEngine.control` on every live replica: the future gets the first replica's result,
        or the first error.

        Raises:
          ValueError: `method` is not a control method.
          EngineDeadError: no replica is running.
        """
        live = self._live()
        if not live:
            raise EngineDeadError("no engine replica is running")
        futures = [replica.control(method, *args) for replica in live]
        done: concurrent.futures.Future = concurrent.futures.Future()
        settling = threading.Lock()  # the replicas' threads answer at once: one of them settles

        def settle(_):
            with settling:
                if done.done() or not all(f.done() for f in futures):
                    return
                errors = [f.exception() for f in futures if f.exception() is not None]
                if errors:
                    done.set_exception(errors[0])
                    return
                if method in REPLAYED_CONTROLS:
                    with self._lock:
                        self._replayed.append((method, args))
                done.set_result(futures[0].result())

        for future in futures:
            future.add_done_callback(settle)
        return done

    # -- state -------------------------------------------------------------------------------

    @property
    def stats(self) -> dict[str, Any]:
        """The live replicas' latest stats, summed (see `combine_stats`)."""
        return combine_stats([r.stats for r in self._live() or self.replicas])

    @property
    def num_unfinished_seqs(self) -> int:
        """Sequences added and not yet finished, on every replica."""
        return sum(r.num_unfinished_seqs for r in self.replicas)

    @property
    def is_running(self) -> bool:
        """False once no replica is left (see `dead`)."""
        return self.dead is None

    @property
    def is_ready(self) -> bool:
        """Every replica started, one at least running, not draining: `/health` (readiness)."""
        return self.ready.is_set() and self.dead is None and not self.draining and bool(self._live())

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops every replica (at once, each as `AsyncEngine.shutdown`)."""
        with self._lock:
            self._stopping = True
        threads = [threading.Thread(target=r.shutdown, args=(timeout,)) for r in self.replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    # -- a replica's death -------------------------------------------------------------------

    def _replica_died(self, rank: int, started: list[AsyncEngine], err: BaseException) -> None:
        """On the dead replica's thread: restarts it if it had served; fails the server if it
        could not start with the others (their configuration is its); else leaves it out."""
        with self._lock:
            if self._stopping:
                return
            served = bool(started) and started[0].ready.is_set()
            restarting = rank in self._restarting
            if served:
                self._restarting.add(rank)
            else:
                self._restarting.discard(rank)
        if served:
            logger.error("engine replica %d died (%s); starting it again", rank, err)
            threading.Thread(target=self._restart, args=(rank,), daemon=True).start()
        elif not restarting:
            logger.error("engine replica %d failed to start (%s)", rank, err)
            self._fail(err)
        else:
            logger.error("engine replica %d failed to start again (%s); serving without it", rank, err)
            with self._lock:
                left = self._restarting or any(r.is_running for r in self.replicas)
            if not left:
                self._fail(err)

    def _restart(self, rank: int) -> None:
        self.replicas[rank] = self._start(rank)

    def _rejoin(self, rank: int, replica: AsyncEngine) -> None:
        """Replays the adapters' loads and removals on a restarted replica, then lets it take work."""
        replica.ready.wait()
        with self._lock:
            replayed = list(self._replayed)
        for method, args in replayed:
            try:
                replica.control(method, *args).result()
            except Exception as err:  # e.g. an adapter that was removed since: nothing to undo
                logger.warning("replica %d: %s%r on rejoining failed: %s", rank, method, args, err)
        with self._lock:
            self._restarting.discard(rank)
        logger.info("engine replica %d is serving again", rank)

    def _fail(self, err: BaseException) -> None:
        """No replica can serve: the server is told (`on_dead`), once."""
        with self._lock:
            if self.dead is not None:
                return
            self.dead = err
        if self._on_dead is not None:
            self._on_dead(err)


class ReplicaStream:
    """A `RequestStream` on one replica that moves to another when its replica dies before it
    streamed anything (the requests are added there again)."""

    def __init__(self, engine: DataParallelEngine, replica: AsyncEngine, stream, request: tuple):
        self.request_ids = request[0]
        self._engine, self._replica, self._stream, self._request = engine, replica, stream, request
        self._started = False

    @property
    def finished(self) -> bool:
        """All requests finished, were aborted, or their replica died."""
        return self._stream.finished

    def __aiter__(self) -> "ReplicaStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            try:
                output = await self._stream.__anext__()
            except EngineDeadError:
                if self._started or self._engine.draining:
                    raise
                logger.info("requests %s move to another replica (theirs died)", self.request_ids)
                replica = self._engine.choose(exclude=self._replica)
                self._replica, self._stream = await self._engine.add_to_live(replica, self._request)
                continue
            self._started = True
            return output

    def abort(self) -> None:
        """Aborts the requests that have not finished; safe to call more than once."""
        self._stream.abort()


def core_replicas(
    config: EngineConfig,
    cores: list[EngineCoreProcess],
    *,
    max_num_waiting: int | None = None,
    on_ready: Callable | None = None,
) -> Callable[[int, Callable[[BaseException], None]], AsyncEngine]:
    """`DataParallelEngine`'s `start_replica` for replicas in engine processes: replica r's first
    `AsyncEngine` runs over `cores[r]` (started already: `EngineCoreProcess(config.for_replica(r))`),
    a restarted one over a new process of the same configuration.

    Args:
      config: the server's configuration (`data_parallel_size` replicas).
      cores: each replica's first engine process.
      max_num_waiting: each replica's, as `AsyncEngine`'s.
      on_ready: passed to each new `EngineCoreProcess`.
    """
    fresh: list[EngineCoreProcess | None] = list(cores)

    def start_replica(rank: int, on_dead: Callable[[BaseException], None]) -> AsyncEngine:
        core, fresh[rank] = fresh[rank], None
        if core is None:
            core = EngineCoreProcess(config.for_replica(rank), on_ready=on_ready)
        return AsyncEngine(core, max_num_waiting=max_num_waiting, on_dead=on_dead)

    return start_replica


async def _add(replica: AsyncEngine, request: tuple):
    request_ids, prompts, params, cache_salt, lora_request = request
    return await replica.add_requests(request_ids, prompts, params, cache_salt=cache_salt, lora_request=lora_request)


def _load(replica: AsyncEngine) -> tuple:
    """vLLM's balancing score: 4 x waiting + running sequences, then the KV cache's usage."""
    unfinished, running_at_most = replica.num_unfinished_seqs, replica.max_num_seqs
    running = min(unfinished, running_at_most)
    return (4 * (unfinished - running) + running, replica.stats.get("gpu_cache_usage_perc", 0.0))


def combine_stats(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's stats from its replicas': numbers summed, lists (per position) summed by
    position, the KV cache's usage recomputed from the summed blocks, the LoRA adapters' names
    joined; a key only some replicas report is summed over those."""
    combined: dict[str, Any] = {}
    for one in stats:
        for key, value in one.items():
            if key not in combined:
                combined[key] = list(value) if isinstance(value, list) else value
            elif isinstance(value, list):
                combined[key] = [a + b for a, b in zip(combined[key], value, strict=True)]
            elif isinstance(value, dict):
                combined[key] = {k: _join(combined[key].get(k, ""), v) for k, v in value.items()}
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                combined[key] += value
    if combined.get("num_total_blocks"):
        combined["gpu_cache_usage_perc"] = 1.0 - combined["num_free_blocks"] / combined["num_total_blocks"]
    return combined


def _join(a: str, b: str) -> str:
    names = sorted(set(filter(None, a.split(","))) | set(filter(None, b.split(","))))
    return ",".join(names)


# What the server's routes drive: one engine, or replicas behind a `DataParallelEngine`.
EngineClient = AsyncEngine | DataParallelEngine
