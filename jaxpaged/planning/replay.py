"""The throughput model's replay: the engine's own scheduler over a workload, each step priced by
`step_cost.StepCoster`, on a simulated clock (no JAX here).

1. Requests reach the scheduler (`jaxpaged.core.scheduler.Scheduler`, the engine's, with the
   engine's limits and a pool as large as the memory plan makes it) when the simulated clock
   passes their send time (arrival, or a free slot under a concurrency cap).
2. Each `schedule()` is one program: a mixed step (any prefill: the ragged kernel), a decode step
   (the decode kernel), or `num_scheduler_steps` fused decode steps, padded to the bucket the
   engine's rule gives (`buckets.BucketRule`). It starts when the device is free and the host
   has packed it (`host_program_s`), and takes the priced time of its steps.
3. With async scheduling (the engine's default) the host schedules program N+1 while N runs and
   reads N's tokens when N ends: host time is hidden unless it exceeds the device's. Without it,
   every program waits for the one before and pays the host time on top.
4. A program's sampled tokens reach their requests when it ends (a fused window's k tokens at
   once: one delivery, as a stream receives them); `postprocess` gets token 5 for every row
   (EOS is ignored, as the benchmarks run, so the values do not matter).
"""

import dataclasses
import heapq
import itertools
from collections import deque

from jaxpaged.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from jaxpaged.core.sequence import Sequence
from jaxpaged.planning.buckets import BucketRule
from jaxpaged.planning.step_cost import StepCoster, StepTime
from jaxpaged.planning.workloads import Workload
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

SAMPLED_TOKEN = 5


@dataclasses.dataclass(frozen=True)
class EngineSetup:
    """How the replayed engine runs.

    Attributes:
      scheduler: the scheduler's limits and pool (`num_blocks` from the memory plan).
      async_scheduling: program N+1 scheduled while N runs (the engine's default).
      stream: requests stream their tokens (`bench serve`): a batch with a streamed request does
        not fuse decode steps (the engine since 2026-12-02; the first H100 run fused them).
    """

    scheduler: SchedulerConfig
    async_scheduling: bool = True
    stream: bool = False


@dataclasses.dataclass
class RequestTimes:
    """One request's life on the simulated clock (seconds)."""

    prompt_len: int
    output_len: int
    sent: float = 0.0
    deliveries: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (time, tokens)

    @property
    def first_token(self) -> float:
        return self.deliveries[0][0]

    @property
    def finished(self) -> float:
        return self.deliveries[-1][0]


@dataclasses.dataclass
class StepRecord:
    """One program: its kind ("mixed", "decode" or "fused"), fused steps, bucket, real tokens and
    sequences (of its first step), and when it ran."""

    kind: str
    num_steps: int
    tokens: int
    seqs: int
    real_tokens: int
    real_seqs: int
    start: float
    end: float


@dataclasses.dataclass
class ReplayResult:
    """What a replay measured.

    Attributes:
      requests: every request's times, in workload order.
      steps: every program, in order.
      time: device seconds by cost term.
      duration: from 0 to the last token.
      max_running: most sequences running in one step.
      num_preemptions: preemptions the scheduler made.
    """

    requests: list[RequestTimes]
    steps: list[StepRecord]
    time: StepTime
    duration: float
    max_running: int
    num_preemptions: int


class Replay:
    """One workload through one engine setup (see the module docstring); `run()` once."""

    def __init__(self, workload: Workload, arrivals: list[float], setup: EngineSetup, buckets: BucketRule, coster):
        if len(arrivals) != len(workload.requests):
            raise ValueError(f"{len(arrivals)} arrival times for {len(workload.requests)} requests")
        self.workload, self.setup, self.buckets, self.coster = workload, setup, buckets, coster
        self.sch = Scheduler(setup.scheduler)
        self.times = [RequestTimes(r.prompt_len, r.output_len) for r in workload.requests]
        self._queue = deque(sorted(range(len(arrivals)), key=lambda i: (arrivals[i], i)))
        self._arrivals = arrivals
        cap = workload.max_concurrency or len(arrivals)
        self._free_slots = [0.0] * min(cap, max(len(arrivals), 1))  # when each slot is next free
        self._by_seq: dict[int, int] = {}
        self._ids = itertools.count()
        self._prefix: list[int] = []
        self.steps: list[StepRecord] = []
        self.total = StepTime()
        self.max_running = 0

    # -- requests ------------------------------------------------------------------------------

    def _prompt(self, shared: int, length: int) -> list[int]:
        """Token ids: the workload's shared prefix, then ids no other prompt has (no accidental
        prefix-cache hits)."""
        while len(self._prefix) < shared:
            self._prefix.append(next(self._ids))
        return self._prefix[:shared] + [next(self._ids) for _ in range(length - shared)]

    def _next_send_time(self) -> float | None:
        """When the next request is sent (its arrival, or a slot freeing), None: none can be yet."""
        if not self._queue or not self._free_slots:
            return None
        return max(self._arrivals[self._queue[0]], self._free_slots[0])

    def _admit(self, now: float) -> None:
        kind = RequestOutputKind.DELTA if self.setup.stream else RequestOutputKind.FINAL_ONLY
        while (send := self._next_send_time()) is not None and send <= now:
            i = self._queue.popleft()
            heapq.heappop(self._free_slots)
            r = self.workload.requests[i]
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=1.0, output_kind=kind)
            seq = Sequence(str(i), self._prompt(r.shared_prefix, r.prompt_len), params)
            self.sch.add(seq)
            self._by_seq[seq.seq_id] = i
            self.times[i].sent = send

    # -- steps ---------------------------------------------------------------------------------

    def _price(self, out: SchedulerOutput) -> tuple[str, float, StepTime]:
        """The program's kind, its device seconds and their split."""
        inputs = out.step_inputs
        n = len(inputs)
        real = sum(len(s.token_ids) for s in inputs)
        t, s = self.buckets(real, n)
        time = StepTime()
        if out.num_steps > 1:
            kind = "fused"
            computed = [x.num_computed for x in inputs]
            for j in range(out.num_steps):
                live = [c + 1 + j for c, x in zip(computed, inputs) if x.live_steps > j]
                time.add(self.coster.step(t, s, sum(live), []))
        else:
            chunks = [(len(x.token_ids), x.num_computed + len(x.token_ids)) for x in inputs]
            prefill = [c for c in chunks if c[0] > 1] if any(q > 1 for q, _ in chunks) else []
            decode_kv = sum(kv for q, kv in chunks if q == 1)
            kind = "mixed" if prefill else "decode"
            time = self.coster.step(t, s, decode_kv, prefill)
        self.steps.append(StepRecord(kind, out.num_steps, t, s, real, n, 0.0, 0.0))
        return kind, time.total, time

    def _deliver(self, out: SchedulerOutput, end: float) -> None:
        fused = out.num_steps > 1
        tokens = [[SAMPLED_TOKEN] * x.live_steps if fused else SAMPLED_TOKEN for x in out.step_inputs]
        for _, seq, count in self.sch.postprocess(out, tokens):
            i = self._by_seq[seq.seq_id]
            self.times[i].deliveries.append((end, count))
            if seq.is_finished:
                heapq.heappush(self._free_slots, end)

    def run(self) -> ReplayResult:
        """Replays every request to its last token.

        Raises:
          RuntimeError: the scheduler stops making progress with requests unfinished.
        """
        host = self.coster.costs.host_program_s
        now = device_free = 0.0  # when the host next schedules; when the device is next idle
        in_flight: deque[tuple[SchedulerOutput, float]] = deque()
        while True:
            self._admit(now)
            out = self.sch.schedule() if self.sch.has_unfinished() else None
            if out is not None and out.is_empty:
                out = None
            if out is not None:
                self.max_running = max(self.max_running, self.sch.num_running)
                _, seconds, split = self._price(out)
                start = max(device_free, now + host)
                device_free = start + seconds
                self.steps[-1].start, self.steps[-1].end = start, device_free
                self.total.add(split)
                in_flight.append((out, device_free))
            delivered = bool(in_flight) and (len(in_flight) > 1 or out is None or not self.setup.async_scheduling)
            if delivered:
                prev, end = in_flight.popleft()
                now = max(now + host, end)
                self._deliver(prev, end)
            elif out is not None:
                now += host
            if out is None and not delivered:  # nothing ran, nothing came back: wait for a request
                send = self._next_send_time()
                if send is not None:
                    now = max(now, send)
                    continue
                if not self.sch.has_unfinished() and not self._queue:
                    break
                raise RuntimeError(
                    f"the replay is stuck: {self.sch.num_waiting} waiting, {self.sch.num_running} running"
                )
        return ReplayResult(
            requests=self.times,
            steps=self.steps,
            time=self.total,
            duration=max((t.finished for t in self.times), default=0.0),
            max_running=self.max_running,
            num_preemptions=self.sch.num_preemptions,
        )


def replay(workload: Workload, arrivals: list[float], setup: EngineSetup, buckets: BucketRule, coster: StepCoster):
    """`Replay(...).run()`: see `Replay`."""
    return Replay(workload, arrivals, setup, buckets, coster).run()
