"""The runner of a pipelined engine (pipeline parallelism): every step is one pipeline tick
that carries the micro-batches in flight from step to step (`pipeline_feed`), so in steady
state every stage works every tick instead of idling (P - 1) / P of a decode step.

Its one stage of `ModelRunner.execute` (`_dispatch_step`) packs the scheduled step as the
entering micro-batch, dispatches one tick (the compiled step program with the carry donated like
the pool), and samples the micro-batch that left the last stage, which entered P - 1 steps
earlier: the handles it yields are that micro-batch's (none while the pipeline fills). A leaving micro-batch's token masks are filled
then, from its constraints as the engine has left them: the previous tokens of its sequences
came back steps before.

Ticks that feed nothing drain the pipeline, before:
- a micro-batch of another shape (decode against ragged, or a larger token bucket): the carry
  holds one (a micro-batch that fits the carry's bucket is packed in it);
- the host tier's copies (loads, swaps, offloads): they touch every stage's layers of a block at
  once, while a micro-batch in flight may still write a block freed under it (an aborted
  sequence's);
- the write-through copies of a step's blocks (disk tier): a block is whole only once the
  micro-batch that writes it has left the last stage.
"""

import jax
import numpy as np

from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.model.sampler import SamplerOptions
from jaxpaged.parallel.multihost import EXECUTE
from jaxpaged.structured.constraint import fill_bitmask
from jaxpaged.worker.model_runner import (
    ModelRunner,
    StepHandle,
    live_entries,
    mask_rows,
    num_drafts_of,
    option_bits,
)
from jaxpaged.worker.pipeline_feed import CarryKey, MicroBatch, PipelineFeed
from jaxpaged.worker.step_packer import Layout, mask_words
from jaxpaged.worker.step_programs import Program, ResultLayout, sampler_for

ENTERING = 1 << 4  # step-channel header bit: a micro-batch enters at this tick (else a drain tick)


class PipelinedRunner(ModelRunner):
    """A `ModelRunner` whose steps are pipeline ticks (arguments: `ModelRunner`'s; the engine's
    `pipeline_parallel_size` > 1)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.feed = PipelineFeed(self.pipeline.size)
        self._no_step: dict[Layout, jax.Array] = {}  # a packed step of no sequences, per layout
        self.num_ticks = 0  # ticks run, drain ticks included
        self.num_drain_ticks = 0  # ticks that fed nothing to let a copy or another shape through
        self.busy_stage_ticks = 0  # over the ticks, the stages that had a micro-batch

    @property
    def bubble(self) -> float:
        """The stages' idle share of the ticks run so far (0: every stage busy every tick)."""
        return 1 - self.busy_stage_ticks / max(1, self.num_ticks * self.pipeline.size)

    @property
    def busy(self) -> bool:
        """Whether a micro-batch is in the pipeline or a step's handle is still to be handed over
        (the engine steps until neither is)."""
        return self.feed.busy or super().busy

    @property
    def in_flight_seq_ids(self) -> frozenset[int]:
        """Sequences in a micro-batch still in the pipeline (the scheduler passes over them)."""
        return self.feed.seq_ids()

    def _dispatch_step(self, output: SchedulerOutput, prepared) -> list[StepHandle]:
        """One tick with the scheduled step entering (none entering when the schedule is empty
        and micro-batches are in flight), after the drain ticks it needs (see the module doc).
        Returns the handles of the micro-batches that left, oldest first."""
        if prepared is None:
            return self._tick(None) if self.feed.busy else []
        entering = self._micro_batch(output, prepared)
        handles = self._drain() if self.feed.must_drain_for(entering.key) else []
        return handles + self._tick(entering)

    def follow_step(self, fields: tuple[int, ...], payload: np.ndarray) -> None:
        """A follower's tick, as the leader sent it: the entering micro-batch's fields (when one
        enters), then the leaving one's token mask (when it has one)."""
        program, options = self.program_from_fields(fields)
        key = CarryKey(program.tokens, program.decode)
        layout = self.step_programs.layout(program)
        entering = None
        if fields[3] & ENTERING:
            entering = MicroBatch(key, program.prompt_logprobs, options, payload[: layout.size])
            payload = payload[layout.size :]
        leaving = self.feed.leaving()
        mask = payload.reshape(self._mask_shape(layout)) if leaving is not None and leaving.options.mask else None
        self._dispatch(key, entering, mask)

    def _micro_batch(self, output: SchedulerOutput, prepared) -> MicroBatch:
        """The scheduled step packed as a micro-batch (its fields on the host until it enters)."""
        inputs = output.step_inputs
        prompt_logprobs = any(s.prompt_targets for s in inputs)
        decode = all(len(s.token_ids) == 1 for s in inputs) and not prompt_logprobs
        masked = prepared.options.mask
        # A micro-batch that fits the bucket of those in flight (of its attention form) is packed
        # in it: every stage runs the carry's shape anyway, and a smaller bucket would drain them.
        feed = self.feed
        floor = feed.key.tokens if feed.busy and feed.key.decode == decode else 0
        tokens, flat = self.packer.pack(
            inputs,
            prepared.rows,
            prepared.resets,
            num_drafts_of(output),
            decode=decode,
            masked=masked,
            min_bucket=floor,
        )
        key = CarryKey(tokens, decode)
        layout = self._layout(key)
        fields = flat[: layout.size].copy()  # the packer reuses its buffers
        mask = self.packer.mask_of(layout, flat).copy() if masked else None
        seq_ids = frozenset(s.seq_id for s in inputs if s.samples)  # a prompt's next chunk may follow
        return MicroBatch(key, prompt_logprobs, prepared.options, fields, mask, output, seq_ids)

    def _drain(self) -> list[StepHandle]:
        """Ticks that feed nothing until no micro-batch is in flight; returns their handles."""
        handles = []
        while self.feed.busy:
            self.num_drain_ticks += 1
            handles += self._tick(None)
        return handles

    def _tick(self, entering: MicroBatch | None) -> list[StepHandle]:
        """The leader's tick: the leaving micro-batch's masks filled, the tick sent to the other
        processes and dispatched; the leaving micro-batch's handle (if one left)."""
        key = entering.key if entering is not None else self.feed.key
        layout = self._layout(key)
        leaving = self.feed.leaving()
        mask = None
        if leaving is not None and leaving.options.mask:
            out = leaving.output
            entries = live_entries(out, [i for i, s in enumerate(out.step_inputs) if s.constraint is not None])
            rows = mask_rows(out.step_inputs, num_drafts_of(out), entries, layout.rows_per_seq)
            fill_bitmask(self.mask_executor(), rows, leaving.mask)
            mask = leaving.mask
        if self.channel is not None:
            options = entering.options if entering is not None else SamplerOptions()
            bits = option_bits(options) | int(entering is not None and entering.prompt_logprobs) << 3
            bits |= ENTERING if entering is not None else 0
            parts = ([entering.flat] if entering is not None else []) + ([mask.reshape(-1)] if mask is not None else [])
            payload = np.concatenate(parts) if parts else np.zeros(0, np.int32)
            self.channel.send(EXECUTE, (key.tokens, 1, int(key.decode), bits), payload)
        packed, prompt_packed, leaving = self._dispatch(key, entering, mask)
        if leaving is None:
            return []
        rows = layout.num_seqs * layout.rows_per_seq
        result_layout = ResultLayout(rows, layout.num_seqs, leaving.options.logprobs, layout.rows_per_seq > 1)
        return [StepHandle(leaving.output, packed, result_layout, prompt_packed)]

    def _dispatch(self, key: CarryKey, entering: MicroBatch | None, mask: np.ndarray | None):
        """Runs one tick on the device (every process alike) and the leaving micro-batch's
        sampler; returns `(packed results, packed prompt logprobs, the leaving micro-batch)`
        (None when none left)."""
        feed, layout = self.feed, self._layout(key)
        if not feed.busy and (feed.carry is None or feed.key != key):
            feed.key, feed.carry = key, self.step_programs.carry.empty(layout, key.decode)
        leaving = feed.leaving()
        if entering is not None:  # (with several processes a transfer is a collective: here, in step)
            entering.flat = jax.device_put(entering.flat, self._whole)
        flat = entering.flat if entering is not None else self._empty_step(layout)
        prompt = leaving is not None and leaving.prompt_logprobs
        program = Program(key.tokens, 1, key.decode, SamplerOptions(), prompt)
        out = self.executable(program)(self.params, self.cache, feed.carry, flat, leaving.flat if leaving else flat)
        self.cache, feed.carry, logits, sampler_input = out[:4]
        self.busy_stage_ticks += (entering is not None) + sum(m is not None for m in feed.in_flight)
        feed.advance(entering)
        self.num_ticks += 1
        if leaving is None:
            return None, None, None
        sampler = self.compiled[sampler_for(layout, leaving.options)]
        device_mask = None if mask is None else jax.device_put(mask, self._whole)
        packed = self._run_sampler(sampler, logits, sampler_input, device_mask)
        packed.copy_to_host_async()
        prompt_packed = out[4] if prompt else None
        if prompt_packed is not None:
            prompt_packed.copy_to_host_async()
        return packed, prompt_packed, leaving

    def _layout(self, key: CarryKey) -> Layout:
        return self.step_programs.layout(Program(key.tokens, 1, key.decode))

    def _empty_step(self, layout: Layout) -> jax.Array:
        """A packed step of no sequences in `layout` (a drain tick's entering micro-batch)."""
        if layout not in self._no_step:
            self._no_step[layout] = jax.device_put(np.zeros(layout.size, np.int32), self._whole)
        return self._no_step[layout]

    def _mask_shape(self, layout: Layout) -> tuple[int, int]:
        return layout.num_seqs * layout.rows_per_seq, mask_words(self.packer.vocab_size)
