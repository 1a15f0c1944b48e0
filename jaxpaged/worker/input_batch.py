"""The runner's per-sequence state between steps (host only, numpy, no JAX): which slot each
running sequence holds (its row of the penalty tables, of `last_tokens` and of the step packer's
block-table matrix), its sampling row, and what a step must do to a slot it takes.

The scheduler says which sequences a step computes and which have finished or were preempted
since the previous step (`SchedulerOutput.released_seq_ids`); this batch turns that into the
packer's rows, the slots to reset (or seed with a reused prefix's tokens) and the step's sampler
options.
"""

import dataclasses

import numpy as np

from jaxpaged.core.step_inputs import ScheduledSequence
from jaxpaged.model.sampler import SamplerOptions
from jaxpaged.worker.step_fields import MAX_BANNED
from jaxpaged.worker.step_packer import SequenceRow, StepPacker, sampling_row


def banned_ids(params, eos_token_ids) -> tuple[int, ...]:
    """What a sequence may not sample before its `min_tokens`: EOS (unless ignored) and its stop
    token ids."""
    eos = () if params.ignore_eos else eos_token_ids
    return tuple(sorted(set(eos) | set(params.stop_token_ids)))


@dataclasses.dataclass
class PreparedStep:
    """What packing and running one step needs besides its `ScheduledSequence`s.

    Attributes:
      rows: each sequence's packing row (slot, sampling row, banned ids).
      resets: slots to clear in the step (sequences starting with nothing reused).
      seeds: `(slot, prefix token ids, prompt length)` of slots to seed before the step.
      options: the sampler paths the step's sequences need.
    """

    rows: list[SequenceRow]
    resets: list[int]
    seeds: list[tuple[int, list[int], int]]
    options: SamplerOptions


class InputBatch:
    """Slots and sampling rows of the running sequences.

    Args:
      packer: the step packer (its block-table rows follow the slots).
      max_num_seqs: slots.
      eos_token_ids: banned before `min_tokens` unless a request ignores EOS.
    """

    def __init__(self, packer: StepPacker, max_num_seqs: int, eos_token_ids: frozenset[int] = frozenset()):
        self.packer = packer
        self.eos_token_ids = eos_token_ids
        self._free = list(range(max_num_seqs - 1, -1, -1))
        self._rows: dict[int, SequenceRow] = {}  # seq_id -> its row, slot included

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def slot_of(self, seq_id: int) -> int | None:
        row = self._rows.get(seq_id)
        return None if row is None else row.slot

    def row_of(self, seq_id: int) -> SequenceRow:
        """The row of a sequence holding a slot."""
        return self._rows[seq_id]

    def release(self, seq_ids: list[int]) -> None:
        """Frees the slots of sequences that finished or were preempted (unknown ids: nothing)."""
        for seq_id in seq_ids:
            row = self._rows.pop(seq_id, None)
            if row is not None:
                self.packer.release(row.slot)
                self._free.append(row.slot)

    def prepare(self, inputs: list[ScheduledSequence]) -> PreparedStep:
        """The rows of a step's sequences; a sequence that starts this step (`admitted`) takes a
        free slot, reset in the step or seeded before it."""
        rows, resets, seeds = [], [], []
        filtering = logprobs = masked = False
        for inp in inputs:
            row = self._rows.get(inp.seq_id)
            if row is None:
                if not inp.admitted:
                    raise RuntimeError(f"sequence {inp.seq_id} holds no slot but was not admitted this step")
                row = self._rows[inp.seq_id] = self._new_row(inp)
                if inp.prefix_token_ids:
                    seeds.append((row.slot, inp.prefix_token_ids, inp.prompt_len))
                else:
                    resets.append(row.slot)
            sp = inp.params
            filtering |= sp.top_k > 0 or sp.top_p < 1
            logprobs |= bool(sp.logprobs)
            masked |= inp.constraint is not None
            rows.append(row)
        full = filtering or logprobs  # one sampler takes both paths (see ENGINE_SAMPLER_OPTIONS)
        return PreparedStep(rows, resets, seeds, SamplerOptions(filter=full, logprobs=full, mask=masked))

    def _new_row(self, inp: ScheduledSequence) -> SequenceRow:
        sp = inp.params
        slot = self._free.pop()
        banned = banned_ids(sp, self.eos_token_ids) if sp.min_tokens else ()
        if len(banned) > MAX_BANNED:  # add_request refuses these first
            raise ValueError(f"with min_tokens > 0, at most {MAX_BANNED} stop_token_ids plus EOS ids are supported")
        bias = None
        if sp.logit_bias:  # add_request checked the count and the ids
            bias = (
                np.fromiter(sp.logit_bias.keys(), np.int32, len(sp.logit_bias)),
                np.fromiter(sp.logit_bias.values(), np.float32, len(sp.logit_bias)),
            )
        row = sampling_row(sp, inp.index, inp.prompt_len)
        return SequenceRow(inp.seq_id, row, slot, inp.prompt_len, banned, bias)
