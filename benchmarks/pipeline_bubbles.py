"""Pipeline parallelism on 8 fake CPU devices: tokens/s at PP 1, 2 and 4 over the same 8 devices,
and the bubble measured against its formula.

A step of M micro-batches over P stages runs M + P - 1 ticks; in each, every stage runs its
layer slots over one micro-batch, or (an idle stage: the bubble) over one whose results are
dropped. So the share of the devices' work spent idle is (P - 1) / (M + P - 1). Here the stages
compute through their idle ticks and 8 fake devices share this machine's cores, so a step's time
follows the work all devices do: measured bubble = 1 - t(PP 1) / t(PP P, M), the same work done
by 8-way tensor parallelism with no idle ticks being the reference. (On GPUs an idle tick costs
wall time instead of compute: the formula is the same.)

The model is sized so that a step is compute (8 layers, hidden 512, MLP 2048, 8 heads; a
256-token prefill step: 4 sequences of 64), float32 random weights, the jnp attention reference.
Every configuration is compiled first, then timed in `REPEATS` rounds over all of them (median
per configuration), so the shared machine's drifting load falls on each alike.
`benchmarks/pipeline_carried.py` measures the micro-batches carried from step to step instead.

    python -m benchmarks.pipeline_bubbles benchmarks/results/pipeline_bubbles_cpu.json
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from benchmarks.results_files import save_results  # noqa: E402
from jaxpaged.config.hf_config import model_config_from_hf
from jaxpaged.config.model_config import ModelConfig  # noqa: E402
from jaxpaged.core.step_inputs import ScheduledSequence  # noqa: E402
from jaxpaged.model import Llama, init_kv_pool  # noqa: E402
from jaxpaged.model.kv_pool import KVPool  # noqa: E402
from jaxpaged.model.layer_arrays import place_params  # noqa: E402
from jaxpaged.parallel.mesh import TensorParallel  # noqa: E402
from jaxpaged.parallel.pipeline import PipelineLayout  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402
from jaxpaged.worker.step_packer import SequenceRow, StepPacker, sampling_row  # noqa: E402
from jaxpaged.worker.step_programs import unpack  # noqa: E402

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512,
    "intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}
DEVICES, SEQS, SEQ_TOKENS, BLOCK_SIZE, REPEATS = 8, 4, 64, 16, 7
# (stages, micro-batches per step): PP 1 is the reference; each P with 1, P, 2P and 4P micro-batches
RUNS = [(1, 1), (2, 1), (2, 2), (2, 4), (2, 8), (4, 1), (4, 4), (4, 8), (4, 16)]


@dataclasses.dataclass(frozen=True)
class Built:
    """A model over `stages` x (8 / `stages`) devices: its parts as the step programs take them."""

    model: Llama
    parallel: TensorParallel
    graphdef: nnx.GraphDef
    state: nnx.State
    pool: KVPool


def build(config: ModelConfig, stages: int, num_blocks: int, microbatches: int | None = None) -> Built:
    """The model (random weights) over `stages` stages of 8 / `stages` devices, its parameters
    and a pool of `num_blocks` blocks per layer placed."""
    pipeline = PipelineLayout(config.num_layers, stages, microbatches=microbatches)
    parallel = TensorParallel.create(config, DEVICES // stages, pipeline=pipeline)
    model = Llama(config, jnp.float32, rngs=nnx.Rngs(0), attention="reference", parallel=parallel)
    graphdef, state = nnx.split(model)
    pool = init_kv_pool(model.pool_config, num_blocks, BLOCK_SIZE, "float32")
    put = functools.partial(jax.device_put, device=parallel.pool_sharding)
    pool = dataclasses.replace(pool, k=put(pool.k), v=put(pool.v))
    return Built(model, parallel, graphdef, place_params(state, parallel), pool)


@dataclasses.dataclass(frozen=True)
class Workload:
    """A step of `count` sequences of `new_tokens` tokens each after `context` in the pool."""

    name: str
    count: int
    new_tokens: int
    context: int = 0
    decode: bool = False  # the engine's decode programs (one token per sequence, decode_only)

    @property
    def pages(self) -> int:
        return -(-(self.context + self.new_tokens) // BLOCK_SIZE)

    @property
    def num_blocks(self) -> int:  # per layer: each sequence's pages and the null block
        return self.count * self.pages + 1

    def packer(self, vocab_size: int) -> StepPacker:
        return StepPacker(
            block_size=BLOCK_SIZE,
            max_model_len=self.context + self.new_tokens,
            max_num_seqs=self.count,
            max_num_batched_tokens=self.count * self.new_tokens,
            vocab_size=vocab_size,
        )

    def sequences(self, vocab_size: int) -> list[tuple[ScheduledSequence, SequenceRow]]:
        """Its sequences (random tokens, each its own blocks from block 1 on) as `packed` takes them."""
        rng = np.random.default_rng(0)
        greedy = sampling_row(SamplingParams(temperature=0), 0)
        return [
            (
                ScheduledSequence(
                    rng.integers(1, vocab_size, self.new_tokens).tolist(),
                    self.context,
                    list(range(1 + s * self.pages, 1 + (s + 1) * self.pages)),
                ),
                SequenceRow(s, greedy, s, self.context + self.new_tokens),
            )
            for s in range(self.count)
        ]


PREFILL = Workload("prefill", SEQS, SEQ_TOKENS)


def packed(packer: StepPacker, seqs, parallel: TensorParallel, decode: bool = False):
    """`seqs` (`sequences`' pairs) as one step's inputs on the devices: `(layout, flat)`."""
    tokens, flat = packer.pack([s for s, _ in seqs], [r for _, r in seqs], [], decode=decode)
    layout = (packer.decode_layouts if decode else packer.layouts)[tokens]
    return layout, jax.device_put(np.array(flat), parallel.sharding())  # a copy: the packer reuses its buffer


def step_input(layout, decode: bool, flat):
    """`unpack` with the metadata's `decode_only` set as the engine's decode programs set it."""
    inp = unpack(layout, flat)
    return dataclasses.replace(inp, metadata=dataclasses.replace(inp.metadata, decode_only=decode))


@functools.partial(jax.jit, static_argnums=(0, 1, 2), donate_argnums=(4,))
def step(layout, decode: bool, graphdef, state, pool, flat):
    """One packed step (`_pipelined` under pipeline parallelism): the pool and the logits of each
    sequence's last token."""
    inp = step_input(layout, decode, flat)
    model = nnx.merge(graphdef, state)
    hidden, pool = model(inp.token_ids, pool, inp.metadata)
    return pool, model.compute_logits(hidden[inp.logits_indices])


def timed(run) -> float:
    """Seconds `run()` takes, its result waited for."""
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


def interleaved(runs: list, repeats: int) -> list[list[float]]:
    """Every `run()` (seconds each) timed `repeats` times, in rounds over all of them: the shared
    machine's drifting load falls on each alike."""
    times = [[] for _ in runs]
    for round_ in range(repeats):
        for i, run in enumerate(runs):
            times[i].append(run())
        print(f"round {round_ + 1}/{repeats}", flush=True)
    return times


def prepare(config: ModelConfig, stages: int, micro: int | None, work: Workload = PREFILL):
    """`work`'s step at `stages` x (8 / `stages`) devices (`micro` micro-batches; None: the
    default), compiled and run once: returns `(run one step and wait -> seconds, facts)`."""
    built = build(config, stages, work.num_blocks, micro)
    layout, flat = packed(
        work.packer(config.vocab_size), work.sequences(config.vocab_size), built.parallel, work.decode
    )
    holder = {"pool": built.pool}

    def one_step():
        holder["pool"], logits = step(layout, work.decode, built.graphdef, built.state, holder["pool"], flat)
        return logits

    first = timed(one_step)
    used = built.parallel.layout.pipeline.microbatches_for(layout.num_tokens, decode=work.decode)
    facts = {
        "tensor_parallel_size": DEVICES // stages,
        "pipeline_parallel_size": stages,
        "microbatches": used,
        "ticks": used + stages - 1,
        "tokens": layout.num_tokens,
        "first_step_s": first,
        "bubble_formula": (stages - 1) / (used + stages - 1),
    }
    return functools.partial(timed, one_step), facts


def main(out_path: str) -> None:
    config = model_config_from_hf(CONFIG)
    runs = []
    for stages, micro in RUNS:
        runs.append(prepare(config, stages, micro))
        print("compiled", runs[-1][1], flush=True)
    times = interleaved([run for run, _ in runs], REPEATS)
    results = []
    for (_, facts), seconds in zip(runs, times):
        step_s = statistics.median(seconds)
        results.append({**facts, "step_s": step_s, "step_s_all": seconds, "tokens_per_s": facts["tokens"] / step_s})
    reference = results[0]["step_s"]
    for r in results:
        r["bubble_measured"] = 1 - reference / r["step_s"]
        r["ms_per_tick"] = 1000 * r["step_s"] / r["ticks"]
    lines = [
        "| TP x PP | micro-batches | ticks | step ms | ms per tick | tokens/s | vs PP 1 | bubble: formula | measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['tensor_parallel_size']} x {r['pipeline_parallel_size']} | {r['microbatches']} | {r['ticks']} "
            f"| {1000 * r['step_s']:.0f} | {r['ms_per_tick']:.0f} | {r['tokens_per_s']:.0f} "
            f"| {r['tokens_per_s'] / results[0]['tokens_per_s']:.2f}x | {r['bubble_formula']:.2f} "
            f"| {r['bubble_measured']:.2f} |"
        )
    table = "\n".join(lines)
    print(table)
    save_results(
        out_path,
        {"config": CONFIG, "devices": DEVICES, "seqs": SEQS, "seq_tokens": SEQ_TOKENS, "results": results},
        table,
    )


if __name__ == "__main__":
    main(sys.argv[1])
