"""The micro-batches in flight of a pipelined engine (pipeline parallelism): host-side records
only (no JAX here).

Under pipeline parallelism an engine step is one pipeline tick (`functional.forward_tick`): the
step's micro-batch enters the first stage while the micro-batches of the P - 1 steps before it
move on one stage, and the oldest leaves the last stage, to be sampled. A micro-batch's results
therefore come back P - 1 steps after it entered, and a sequence that samples is in at most one
micro-batch in flight (the scheduler passes over those in flight:
`Scheduler.schedule(in_flight=...)`), so in steady state P groups of sequences take turns and
every stage works every tick; a prompt's chunks follow one another tick by tick.

All micro-batches in flight share one carry, so one shape: a micro-batch of another program
(token bucket, or decode against ragged) enters only once the pipeline has drained (ticks that
feed nothing until the last micro-batch in flight has left); the runner packs one that fits the
carry's token bucket in it.
"""

import collections
import dataclasses
import typing

import numpy as np

from jaxpaged.model.sampler import SamplerOptions


class CarryKey(typing.NamedTuple):
    """What fixes a carry's shape: the micro-batches' token bucket and attention form."""

    tokens: int
    decode: bool


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch in the pipeline: what its leaving needs.

    Attributes:
      key: its program's token bucket and attention form (the carry's).
      prompt_logprobs: it wants its tokens' prompt logprobs (computed when it leaves).
      options: its sampler's paths.
      flat: its packed step (the fields, no mask): on the host until it enters, then on the
        device.
      mask: its token mask `[rows, W]` to fill when it leaves (with `options.mask`), else None.
      output: its schedule (`SchedulerOutput`; None on a follower process).
      seq_ids: the sequences it samples a token of (each waits for it before its next step; a
        prompt's chunk that samples nothing may be followed by the next at once: every stage
        runs the micro-batches in the order they entered, so the chunk's K/V is there first).
    """

    key: CarryKey
    prompt_logprobs: bool
    options: SamplerOptions
    flat: typing.Any
    mask: np.ndarray | None = None
    output: typing.Any = None
    seq_ids: frozenset[int] = frozenset()


class PipelineFeed:
    """The micro-batches in flight, oldest first, and the carry that holds them on the device.

    Args:
      stages: P.
    """

    def __init__(self, stages: int):
        self.stages = stages
        self.in_flight: collections.deque[MicroBatch | None] = collections.deque()  # P - 1 once full
        self.key: CarryKey | None = None  # the carry's shape
        self.carry = None  # the device carry (`PipelineCarry`), made for `key`

    @property
    def busy(self) -> bool:
        """Whether a micro-batch is in flight."""
        return any(m is not None for m in self.in_flight)

    def seq_ids(self) -> frozenset[int]:
        """The sequences whose sampled token is in flight (none of them may enter again yet)."""
        return frozenset().union(*(m.seq_ids for m in self.in_flight if m is not None))

    def must_drain_for(self, key: CarryKey) -> bool:
        """Whether a micro-batch of `key` must wait for the pipeline to drain (the carry holds
        micro-batches of another shape)."""
        return self.busy and key != self.key

    def leaving(self) -> MicroBatch | None:
        """The micro-batch the next tick takes out of the last stage (None: none, filling)."""
        return self.in_flight[0] if len(self.in_flight) == self.stages - 1 else None

    def advance(self, entering: MicroBatch | None) -> MicroBatch | None:
        """Records a tick: `entering` went in (None: nothing), the oldest left; returns it."""
        leaving = self.leaving()
        if len(self.in_flight) == self.stages - 1:
            self.in_flight.popleft()
        self.in_flight.append(entering)
        if entering is not None:
            self.key = entering.key
        if not self.busy:
            self.in_flight.clear()  # empty: the next micro-batch may take another shape
        return leaving
