"""Pipeline parallelism with the micro-batches carried from step to step (`Llama.pipeline_tick`)
against today's in-step pipeline (`Llama._pipelined`) and against no stages, on 8 fake CPU
devices (the model and timing of `benchmarks.pipeline_bubbles`, in `ROUNDS` rounds).

Two workloads, each timed as one unit of the same work in every configuration:

- prefill: 4 sequences of 64 new tokens (256 tokens). In-step: one step of M = P micro-batches,
  M + P - 1 ticks. Carried: P ticks, each entering one of P groups of 4 / P sequences (the same
  micro-batches).
- decode: 64 sequences with 64 tokens of context, one new token each. In-step: one decode step
  of all 64 as one micro-batch (`microbatches_for(decode=True)`), P ticks. Carried: P ticks, each
  entering one of P groups of 64 / P sequences (`decode_only`).

The carried runs are timed in their steady state: the pipeline filled first (P - 1 ticks), then
every tick a micro-batch enters and one leaves, so every stage is busy at every tick (bubble
formula 0); the groups take turns, a group entering again at the tick after its previous
micro-batch left. Each tick is one jitted program with the carry and the pool donated (the carry's
activations split over the stages, its metadata whole, as the engine will hold it) returning the
leaving micro-batch's logits, waited for at every tick as an engine step reads its tokens. (The
groups have one layout, so the entering micro-batch's logits rows are the leaving one's; the
groups re-run the same positions, which costs what new ones would.) Measured bubble
= 1 - t(PP 1) / t, as in `pipeline_bubbles`: the 8 fake devices share this machine's cores, so a
unit's time follows the work all devices do, idle ticks' included.

    python -m benchmarks.pipeline_carried benchmarks/results/pipeline_bubbles_carried_cpu.json
"""

import dataclasses
import functools
import os
import statistics
import sys

import jax  # its CPU backend starts at first use: after pipeline_bubbles has asked for 8 devices
import numpy as np
from flax import nnx

from benchmarks.pipeline_bubbles import (
    CONFIG,
    DEVICES,
    PREFILL,
    Workload,
    build,
    interleaved,
    packed,
    prepare,
    step_input,
    timed,
)
from benchmarks.results_files import save_results
from jaxpaged.config.hf_config import model_config_from_hf
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.parallel.sharding import PIPELINE_AXIS

DECODE = Workload("decode", 64, 1, context=64, decode=True)
STAGES = (2, 4)
ROUNDS = 15  # timed units per configuration (interleaved): 30 ticks timed at PP 2, 60 at PP 4


def carried_tick(layout, decode: bool, graphdef, state, carry, pool, flat):
    """One tick: the packed micro-batch `flat` enters; the carry, the pool and the leaving
    micro-batch's logits."""
    inp = step_input(layout, decode, flat)
    model = nnx.merge(graphdef, state)
    hidden, _, carry, pool = model.pipeline_tick(carry, inp.token_ids, pool, inp.metadata)
    return carry, pool, model.compute_logits(hidden[inp.logits_indices])


def groups(items: list, count: int) -> list[list]:
    """`items` cut into `count` consecutive groups of equal size."""
    size, rest = divmod(len(items), count)
    if rest:
        raise ValueError(f"{len(items)} sequences do not split into {count} equal groups")
    return [items[g * size : (g + 1) * size] for g in range(count)]


def prepare_carried(config: ModelConfig, stages: int, work: Workload):
    """`work` in P rotating groups through the carried tick at `stages` x (8 / `stages`) devices,
    compiled and filled: returns `(run P ticks, waiting for each -> seconds, facts)`."""
    built = build(config, stages, work.num_blocks)
    packer = work.packer(config.vocab_size)
    micro = [packed(packer, g, built.parallel, work.decode) for g in groups(work.sequences(config.vocab_size), stages)]
    layout = micro[0][0]
    assert all(m[0] == layout for m in micro), "the groups' micro-batches must share one layout"
    whole = built.parallel.sharding()
    carry = built.model.init_pipeline_carry(step_input(layout, work.decode, micro[0][1]).metadata)
    carry_shardings = dataclasses.replace(
        jax.tree.map(lambda _: whole, carry), hidden=built.parallel.sharding((PIPELINE_AXIS,))
    )
    tick = jax.jit(
        functools.partial(carried_tick, layout, work.decode, built.graphdef),
        donate_argnums=(1, 2),
        out_shardings=(carry_shardings, jax.tree.map(lambda a: a.sharding, built.pool), whole),
    )
    held = {"carry": jax.device_put(carry, carry_shardings), "pool": built.pool, "tick": 0}

    def one_tick():
        flat = micro[held["tick"] % stages][1]
        held["carry"], held["pool"], logits = tick(built.state, held["carry"], held["pool"], flat)
        held["tick"] += 1
        return logits

    first = timed(one_tick)  # compiles
    for _ in range(stages - 2):  # the rest of the filling: the pipeline is full from tick P - 1 on
        timed(one_tick)
    busy = np.asarray(held["carry"].busy)
    assert busy[1:].all(), busy  # every stage but the first holds a micro-batch: steady state

    def unit() -> float:  # one micro-batch of each group: the in-step program's work
        return sum(timed(one_tick) for _ in range(stages))

    facts = {
        "tensor_parallel_size": DEVICES // stages,
        "pipeline_parallel_size": stages,
        "microbatches": stages,
        "ticks": stages,
        "tokens": stages * layout.num_tokens,
        "microbatch_tokens": layout.num_tokens,
        "first_step_s": first,
        "bubble_formula": 0.0,
    }
    return unit, facts


def configurations(config: ModelConfig, work: Workload):
    """`(program, run, facts)` of `work` at PP 1, in-step at each P and carried at each P."""
    out = []
    for stages in (1, *STAGES):
        run, facts = prepare(config, stages, stages if not work.decode else None, work)
        out.append(("in-step" if stages > 1 else "-", run, facts))
        print("compiled", work.name, out[-1][0], facts, flush=True)
    for stages in STAGES:
        run, facts = prepare_carried(config, stages, work)
        out.append(("carried", run, facts))
        print("compiled", work.name, "carried", facts, flush=True)
    return out


def summarise(work: Workload, runs, times) -> list[dict]:
    """Each run's facts with its timings, ratios and measured bubble (run 0 is PP 1)."""
    results = []
    for (program, _, facts), seconds in zip(runs, times):
        unit_s = statistics.median(seconds)
        results.append(
            {
                "workload": work.name,
                "program": program,
                **facts,
                "unit_s": unit_s,
                "unit_s_all": seconds,
                "ms_per_tick": 1000 * unit_s / facts["ticks"],
                "tokens_per_s": facts["tokens"] / unit_s,
                "bubble_measured": 1 - statistics.median(times[0]) / unit_s,
            }
        )
    for r in results:
        r["vs_pp1"] = r["tokens_per_s"] / results[0]["tokens_per_s"]
        if r["program"] == "carried":
            in_step = next(
                s
                for s in results
                if s["program"] == "in-step" and s["pipeline_parallel_size"] == r["pipeline_parallel_size"]
            )
            r["vs_in_step"] = r["tokens_per_s"] / in_step["tokens_per_s"]
    return results


def table(results: list[dict]) -> str:
    lines = [
        "| workload | TP x PP | program | micro-batches x tokens | ticks | ms per tick | ms (ticks x ms per tick) "
        "| tokens/s | vs PP 1 | vs in-step | bubble: formula | measured |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        vs_in_step = f"{r['vs_in_step']:.2f}x" if "vs_in_step" in r else ""
        lines.append(
            f"| {r['workload']} | {r['tensor_parallel_size']} x {r['pipeline_parallel_size']} | {r['program']} "
            f"| {r['microbatches']} x {r['tokens'] // r['microbatches']} | {r['ticks']} | {r['ms_per_tick']:.1f} "
            f"| {1000 * r['unit_s']:.0f} | {r['tokens_per_s']:.0f} | {r['vs_pp1']:.2f}x | {vs_in_step} "
            f"| {r['bubble_formula']:.2f} | {r['bubble_measured']:.2f} |"
        )
    return "\n".join(lines)


def main(out_path: str) -> None:
    config = model_config_from_hf(CONFIG)
    load = {"before": os.getloadavg()}
    results = []
    for work in (PREFILL, DECODE):  # each workload's configurations timed in rounds over all of them
        runs = configurations(config, work)
        results += summarise(work, runs, interleaved([run for _, run, _ in runs], ROUNDS))
    load["after"] = os.getloadavg()
    text = table(results)
    print(text)
    print("load average (1, 5, 15 min) before", load["before"], "after", load["after"])
    report = {
        "config": CONFIG,
        "devices": DEVICES,
        "rounds": ROUNDS,
        "workloads": [dataclasses.asdict(w) for w in (PREFILL, DECODE)],
    }
    save_results(out_path, {**report, "load_average": load, "results": results}, text)


if __name__ == "__main__":
    main(sys.argv[1])
