"""The draft model of speculative decoding (`speculative_config` with a "model"): a smaller model
with the target's vocabulary, on the same devices, with a KV pool of its own.

Its pool has as many blocks as the target's and is indexed by the same block tables: position p
of a sequence sits in the same block and slot in both. It holds only what the draft computed,
which it computes lazily: a step that does not speculate costs the draft nothing. The draft
proposes after a speculating step (`ModelRunner.fetch`, for the step's `drafting` entries), and
for each sequence first catches up: it runs the tokens its pool lacks, from the number it holds
(tracked per sequence, forgotten when the sequence finishes or is preempted) to the sequence's
newest one, the step's accepted proposals included. A sequence new to it (a fresh prompt, a
prefix-cache hit, a resumed preemption) has all its tokens caught up, as a chunked prefill on
the draft: a prefix hit's blocks are written again with the K/V the draft computes for the same
tokens. Then it decodes k steps from the newest token (one fused program), sampling with the
request's own parameters and the same per-position keys the target's sampler uses (so when the
two models agree on a position's distribution they draw the same token, and the target accepts
it). Those k steps write their K/V in the room the scheduler reserved past the step's tokens;
only the tokens before the newest count as held, since the room past the sequence's computed
tokens goes back to the pool after the step (`BlockManager.trim`).
"""

import dataclasses

import jax
import numpy as np

from jaxpaged.core.sequence import Sequence
from jaxpaged.core.step_inputs import ScheduledSequence
from jaxpaged.engine_config import EngineConfig
from jaxpaged.model import Llama
from jaxpaged.model.sampler import SamplerOptions
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.worker.step_packer import SequenceRow
from jaxpaged.worker.step_programs import Program, SamplerProgram, sampler_for

Entry = tuple[ScheduledSequence, SequenceRow]
PROPOSE_OPTIONS = SamplerOptions(filter=True)  # proposals sample as the request does, top-k / top-p included


class DraftRunner(ModelRunner):
    """A `ModelRunner` for the draft model: mixed step programs (model only) to catch up, and k-step
    decode programs to propose, which sample with top-k / top-p filtering.

    Args:
      model: the draft model on the mesh.
      parallel: its sharding table on the target's mesh.
      config: the draft's engine configuration: the target's limits and pool size, the
        draft's model, `num_scheduler_steps` = k (see `draft_engine_config`).
    """

    def __init__(self, model: Llama, *, parallel: TensorParallel, config: EngineConfig):
        super().__init__(model, parallel=parallel, config=config, fused_options=PROPOSE_OPTIONS)
        self.num_proposals = config.scheduler_config().num_scheduler_steps
        self._held: dict[int, int] = {}  # seq_id -> leading tokens whose K/V its pool holds

    def programs(self) -> list[Program | SamplerProgram]:
        """What the draft runs: a mixed step per token bucket (catching up; model only) and, per
        decode bucket, its k-step proposing decode (with k = 1 a decode step and its sampler)."""
        k = self.num_proposals
        runs = [p for p in self.step_programs.all() if not p.decode or p.steps == k]
        if k > 1:
            return runs
        return runs + [sampler_for(self.step_programs.layout(p), PROPOSE_OPTIONS) for p in runs if p.decode]

    def release(self, seq_ids: list[int]) -> None:
        """Forgets sequences that finished or were preempted (their blocks went back)."""
        for seq_id in seq_ids:
            self._held.pop(seq_id, None)

    def propose(
        self, seqs: list[Sequence], new_tokens: list[list[int]], rows: list[SequenceRow]
    ) -> dict[int, list[int]]:
        """k proposed tokens after each sequence's `new_tokens` (a step's, not yet appended), by
        seq_id: the draft first catches up on what its pool lacks (see the module doc). A
        sequence whose table has no room for the k positions past its newest token gets none.

        Args:
          seqs: the sequences, their tokens up to the step's new ones.
          new_tokens: each one's tokens from the step.
          rows: their sampling rows and slots, as the target packs them.
        """
        catch_up: list[Entry] = []
        heads: list[Entry] = []
        k, bs = self.num_proposals, self.block_size
        for seq, new, row in zip(seqs, new_tokens, rows):
            held = self._held.get(seq.seq_id, 0)
            length = seq.num_tokens + len(new)
            if len(seq.block_table) * bs < length + k - 1:
                continue
            tokens = seq.token_ids_slice(held, seq.num_tokens) + new  # [held, length)
            base = ScheduledSequence(
                token_ids=tokens[:-1],
                num_computed=held,
                block_table=seq.block_table,
                seq_id=seq.seq_id,
                samples=False,
                params=seq.sampling_params,
                index=seq.index,
                prompt_len=seq.num_prompt_tokens,
            )
            if len(tokens) > 1:
                catch_up.append((base, row))
            heads.append((dataclasses.replace(base, token_ids=tokens[-1:], num_computed=length - 1, samples=True), row))
            self._held[seq.seq_id] = length - 1
        for chunk in self._chunks(catch_up):
            self._run_model(chunk)
        if not heads:
            return {}
        tokens = self._decode([inp for inp, _ in heads], [row for _, row in heads])
        return {inp.seq_id: proposal for (inp, _), proposal in zip(heads, tokens.tolist())}

    def _chunks(self, entries: list[Entry]) -> list[list[Entry]]:
        """`entries` in calls of at most the largest token bucket's tokens and sequences: a long
        catch-up goes on in the next call from where the previous stopped (calls run in order)."""
        limit = max(self.packer.layouts)
        max_seqs = self.packer.layouts[limit].num_seqs
        chunks, chunk, room = [], [], limit
        for inp, row in entries:
            start = 0
            while start < len(inp.token_ids):
                if room == 0 or len(chunk) == max_seqs:
                    chunks.append(chunk)
                    chunk, room = [], limit
                n = min(room, len(inp.token_ids) - start)
                piece = dataclasses.replace(
                    inp, token_ids=inp.token_ids[start : start + n], num_computed=inp.num_computed + start
                )
                chunk.append((piece, row))
                room, start = room - n, start + n
        return chunks + [chunk] if chunk else chunks

    def _run_model(self, entries: list[Entry]) -> None:
        """Writes the K/V of `entries`' tokens into the draft's pool (a mixed step's model program;
        its logits are not read)."""
        t, flat = self.packer.pack([inp for inp, _ in entries], [row for _, row in entries], [])
        flat = jax.device_put(flat.copy(), self._whole)  # a copy: a CPU put aliases the buffer, packed again later
        self.cache, _, _ = self.compiled[Program(t, 1, False)](self.params, self.cache, flat)

    def _decode(self, inputs: list[ScheduledSequence], rows: list[SequenceRow]) -> np.ndarray:
        """k proposed tokens `[n, k]` for `n` sequences, each decoding from its newest token
        (`inputs`: that token at its position; `rows`: their sampling rows and slots)."""
        k = self.num_proposals
        t = self.packer.bucket_for(len(inputs), len(inputs))
        program = Program(t, k, True, PROPOSE_OPTIONS if k > 1 else SamplerOptions())
        live = [k] * len(inputs) if k > 1 else None
        t, flat = self.packer.pack(inputs, rows, [], decode=True, live_steps=live)
        layout = self.step_programs.layout(program)
        packed = np.asarray(self.run_packed(program, PROPOSE_OPTIONS, flat))
        values = packed[..., : layout.num_seqs * layout.rows_per_seq].reshape(k, -1)
        return values[:, : len(inputs)].T


def draft_engine_config(config: EngineConfig, layout) -> EngineConfig:
    """The draft runner's configuration: the target's (planned pool size included) with the
    draft's model (`layout`: its split over the mesh), `num_scheduler_steps` = k (its proposing
    programs) and no proposals of its own to check, no host tier, unquantized weights."""
    scheduling = dataclasses.replace(config.scheduling, num_scheduler_steps=config.speculative.num_speculative_tokens)
    return dataclasses.replace(
        config,
        model=layout.config,
        layout=layout,
        load=dataclasses.replace(config.load, quantization=None),
        cache=dataclasses.replace(config.cache, num_host_blocks=0),
        scheduling=scheduling,
        speculative=None,
        draft=None,
    )
