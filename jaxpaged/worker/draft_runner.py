"""The draft model of speculative decoding (`speculative_config` with a "model"): a smaller model
with the target's vocabulary, on the same devices, with a KV pool of its own.

Its pool mirrors the target's block for block: it has as many blocks, and every step the target
computes is run on it too (`mirror`: the same program on the same packed buffer, so the draft
writes its K/V for exactly the tokens, positions and blocks the target wrote). A block therefore
holds both models' K/V of the same tokens, and the block manager, the prefix cache and
preemption serve both without knowing of the draft.

Before a step that checks proposals, `propose` runs the draft's fused decode program for k steps
from each drafting sequence's pending token, sampling with the request's own parameters and the
same per-position keys the target's sampler uses (so when the two models agree on a position's
distribution they draw the same token, and the target accepts it).
"""

import dataclasses

import numpy as np

from jaxpaged.core.step_inputs import ScheduledSequence
from jaxpaged.engine_config import EngineConfig
from jaxpaged.model import Llama
from jaxpaged.model.sampler import SamplerOptions
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.worker.step_packer import SequenceRow
from jaxpaged.worker.step_programs import Program


class DraftRunner(ModelRunner):
    """A `ModelRunner` for the draft model: the target's step programs (to mirror them) and its
    own k-step decode programs (to propose), which sample with top-k / top-p filtering.

    Args:
      model: the draft model on the mesh.
      parallel: its sharding table on the target's mesh.
      config: the draft's engine configuration: the target's limits and pool size, the
        draft's model, `num_scheduler_steps` = k (see `draft_engine_config`).
    """

    def __init__(self, model: Llama, *, parallel: TensorParallel, config: EngineConfig):
        super().__init__(model, parallel=parallel, config=config, fused_options=SamplerOptions(filter=True))
        self.num_proposals = config.args.num_scheduler_steps

    def fill_proposals(self, inputs: list[ScheduledSequence], drafts: list[list[int]],
                       rows: list[SequenceRow]) -> tuple[list[ScheduledSequence], list[list[int]]]:  # fmt: skip
        """The step's inputs with the draft model's k tokens in the proposal slots the scheduler
        reserved (`drafts`: placeholders), and the proposals."""
        drafting = [i for i, d in enumerate(drafts) if d]
        own = [dataclasses.replace(inputs[i], token_ids=inputs[i].token_ids[:1]) for i in drafting]
        tokens = self.propose(own, [rows[i] for i in drafting])
        inputs, drafts = list(inputs), list(drafts)
        for i, mine, proposal in zip(drafting, own, tokens.tolist()):
            drafts[i] = proposal
            inputs[i] = dataclasses.replace(inputs[i], token_ids=mine.token_ids + proposal)
        return inputs, drafts

    def propose(self, inputs: list[ScheduledSequence], rows: list[SequenceRow]) -> np.ndarray:
        """k proposed tokens `[n, k]` for `n` decoding sequences (`inputs`: each one's pending token
        at its computed length; `rows`: their sampling rows and slots, as the target packs them)."""
        k = self.num_proposals
        t = self.packer.bucket_for(len(inputs), len(inputs))
        program = Program(t, k, True, self.step_programs.fused_options if k > 1 else SamplerOptions())
        live = [k] * len(inputs) if k > 1 else None
        t, flat = self.packer.pack(inputs, rows, [], decode=True, live_steps=live)
        options = SamplerOptions(filter=True)
        values = self.step_programs_result(program, options, flat)
        return values.reshape(k, -1)[:, : len(inputs)].T

    def step_programs_result(self, program: Program, options: SamplerOptions, flat: np.ndarray) -> np.ndarray:
        """The sampled token ids `[steps, rows]` of a program run on `flat`."""
        layout = self.step_programs.layout(program)
        rows = layout.num_seqs * layout.rows_per_seq
        packed = np.asarray(self.run_packed(program, options, flat))
        return packed[..., :rows].reshape(program.steps, rows)

    def mirror(self, program: Program, flat: np.ndarray) -> None:
        """Runs the target's step (`program` over its packed buffer) on the draft's pool."""
        self.run_model(program, flat)


def draft_engine_config(config: EngineConfig, layout) -> EngineConfig:
    """The draft runner's configuration: the target's (planned pool size included) with the
    draft's model (`layout`: its split over the mesh) and `num_scheduler_steps` = k (its
    proposing programs), no host tier, unquantized weights."""
    args = dataclasses.replace(config.args, num_scheduler_steps=config.args.speculative_config.num_speculative_tokens)
    return dataclasses.replace(config, args=args, model=layout.config, layout=layout, num_host_blocks=0,
                               quantization=None)  # fmt: skip
