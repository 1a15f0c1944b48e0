"""Structured outputs (a JSON schema) against unconstrained generation, in the same run on the
same engine; and grammar compile times.

For each batch size one demo-model engine is built (its defaults: async scheduling, fused decode
steps; no compilation cache, so its start-up compiles every program). B requests, sampled at
temperature 0.8, run constrained by the clinical-notes schema of tests/structured_workload.py (a
dozen fields; a document ends when it is complete), then unconstrained with each request's
max_tokens the length of its constrained output (EOS ignored): the same tokens, contexts and
ragged batch tail, so only the grammar differs. Each mode runs twice; the better run is kept. Per mode: output tokens/s, TPOT (ms per output token of one sequence: wall time x B /
output tokens), and the host's time filling grammar masks per step. Constrained steps run
without fused decode steps (each mask needs the token sampled before it), each read before the
next is scheduled (so forced runs are scheduled whole), the mask filled while the device
computes the step's model program: that, the masks' host time and the masked sampler are what
the ratio measures; a mode with constrained steps overlapped as other steps are (forced runs
cut in two: `json_schema_overlapped`) shows what reading first gains. Two more modes, unconstrained in single
async steps (as constrained steps run now) and in single synchronous steps (as they ran before
the overlap), split the costs: the ratio of the constrained run to the first is the grammar's
own cost.

A last mode runs the constrained requests on a second engine with n-gram speculation
(`SPECULATIVE_CONFIG`, the measured rule deciding which steps speculate): constrained rows then
check the tokens their grammar forces (a schema's keys and punctuation) and n-gram proposals the
grammar allows, each position under its own mask; its ratio is against the first engine's
unconstrained run, with its output tokens per step and how many proposals were checked and kept.

Compile times: the schema's check (`jaxpaged.structured.check`), its compilation cold (a new
backend: no cache) and cached, and the first mask of a fresh matcher; the engine's start-up
compile of the masked samplers against the rest.

    python -m benchmarks.structured_outputs [--batches 1 16 64] [--output FILE.json]

Results: benchmarks/results/structured_outputs_cpu_demo.{json,md}.
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import llguidance
import llguidance.numpy

import jaxpaged.worker.model_runner as model_runner
from benchmarks.results_files import save_results
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
from jaxpaged.sampling_params import SamplingParams, StructuredOutputsParams
from jaxpaged.structured import GrammarBackend, check

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from structured_workload import SCHEMA, obeys  # noqa: E402

MAX_TOKENS = 400  # more than any document of the schema takes
SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4}
PROMPT = "And the LORD spake unto Moses, saying, Write the record of the sick man"


def run_once(
    engine: LLMEngine,
    batch: int,
    lengths: list[int] | None,
    fill_times: list[float],
    single_steps: bool = False,
    sync: bool = False,
    seed: int | None = None,
    overlapped: bool = False,
) -> dict:
    """One run of B requests: constrained (`lengths` None), else unconstrained with these
    max_tokens; `single_steps`: without fused decode steps; `sync`: without async scheduling;
    `seed`: request i sampled with seed `seed + i` (None: unseeded); `overlapped`: constrained
    steps overlapped too (not reading the step in flight first: forced runs cut in two)."""
    constrained, config = lengths is None, engine.scheduler.config
    engine.runner.async_scheduling = not sync
    engine.runner.read_first_under_grammars = not overlapped
    if single_steps:
        engine.scheduler.config = dataclasses.replace(config, num_scheduler_steps=1)
    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    tag = f"{constrained}-{time.perf_counter()}"
    for i in range(batch):
        max_tokens = MAX_TOKENS if constrained else lengths[i]
        params = SamplingParams(
            temperature=0.8,
            max_tokens=max_tokens,
            ignore_eos=not constrained,
            structured_outputs=so,
            seed=None if seed is None else seed + i,
        )
        engine.add_request(f"{tag}-{i}", f"{PROMPT} {i}", params)
    fill_times.clear()
    out_lengths, valid, steps, start = [0] * batch, 0, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                out_lengths[int(out.request_id.rsplit("-", 1)[1])] = len(out.outputs[0].token_ids)
                valid += obeys("json", out.outputs[0].text) if constrained else 1
        steps += 1
    seconds = time.perf_counter() - start
    engine.runner.async_scheduling, engine.scheduler.config, engine.runner.read_first_under_grammars = (
        True,
        config,
        True,
    )
    tokens = sum(out_lengths)
    return {
        "tokens_per_s": round(tokens / seconds, 1),
        "tpot_ms": round(1000 * seconds * batch / tokens, 3),
        "output_tokens": tokens,
        "steps": steps,
        "mask_fill_ms_per_step": round(1000 * sum(fill_times) / steps, 3),
        "valid_fraction": valid / batch,
        "lengths": out_lengths,
    }


def make_engine(batch: int, speculative_config: dict | None = None) -> LLMEngine:
    rows = 1 + (speculative_config or {}).get("num_speculative_tokens", 0)  # room for every proposal
    args = EngineArgs(
        model=DEMO_MODEL_DIR,
        max_model_len=512,
        max_num_seqs=batch,
        max_num_batched_tokens=max(256, batch * rows),
        compilation_cache_dir="none",
        speculative_config=speculative_config,
    )
    return LLMEngine(args)


def measure(batch: int) -> dict:
    engine, spec_engine = make_engine(batch), make_engine(batch, SPECULATIVE_CONFIG)
    samplers = {True: 0.0, False: 0.0}
    for program in engine.runner.compile_report:
        if program.name.startswith("sampler"):
            samplers["mask" in program.name] += program.compile_s
    fill_times: list[float] = []
    fill = model_runner.fill_bitmask

    def timed_fill(*args):
        start = time.perf_counter()
        fill(*args)
        fill_times.append(time.perf_counter() - start)

    model_runner.fill_bitmask = timed_fill
    run_once(engine, min(batch, 4), None, fill_times)  # warm-up (and the grammar compiled)
    run_once(spec_engine, min(batch, 4), None, fill_times)
    spec_engine.spec_stats = dict.fromkeys(spec_engine.spec_stats, 0)
    runs = {
        "unconstrained": [],
        "json_schema": [],
        "json_schema_overlapped": [],
        "unconstrained_single_async_steps": [],
        "unconstrained_single_sync_steps": [],
        "json_schema_speculation": [],
    }
    for _ in range(2):
        runs["json_schema"].append(run_once(engine, batch, None, fill_times))
        lengths = runs["json_schema"][-1]["lengths"]
        runs["json_schema_overlapped"].append(run_once(engine, batch, None, fill_times, overlapped=True))
        runs["unconstrained"].append(run_once(engine, batch, lengths, fill_times))
        single = run_once(engine, batch, lengths, fill_times, single_steps=True)
        runs["unconstrained_single_async_steps"].append(single)
        single_sync = run_once(engine, batch, lengths, fill_times, single_steps=True, sync=True)
        runs["unconstrained_single_sync_steps"].append(single_sync)
        runs["json_schema_speculation"].append(run_once(spec_engine, batch, None, fill_times))
    best = {mode: max(r, key=lambda x: x["tokens_per_s"]) for mode, r in runs.items()}
    for r in best.values():
        del r["lengths"]
    plain, json_ = best["unconstrained"], best["json_schema"]
    single, single_sync = best["unconstrained_single_async_steps"], best["unconstrained_single_sync_steps"]
    row = {
        "batch": batch,
        **best,
        "throughput_ratio": round(json_["tokens_per_s"] / plain["tokens_per_s"], 3),
        "tpot_ratio": round(json_["tpot_ms"] / plain["tpot_ms"], 3),
        "grammar_only_throughput_ratio": round(json_["tokens_per_s"] / single["tokens_per_s"], 3),
        "vs_overlapped_throughput_ratio": round(
            json_["tokens_per_s"] / best["json_schema_overlapped"]["tokens_per_s"], 3
        ),
        "vs_single_sync_throughput_ratio": round(json_["tokens_per_s"] / single_sync["tokens_per_s"], 3),
        "speculation_throughput_ratio": round(
            best["json_schema_speculation"]["tokens_per_s"] / plain["tokens_per_s"], 3
        ),
        "speculation_counters": spec_engine.spec_stats,  # over both runs
        "compile_s_samplers_masked": round(samplers[True], 1),
        "compile_s_samplers_unmasked": round(samplers[False], 1),
        "compile_s_all": round(engine.compile_seconds, 1),
    }
    model_runner.fill_bitmask = fill
    print(json.dumps(row), flush=True)
    return row


def compile_times(repeats: int = 5) -> dict:
    """Milliseconds: the schema's check, its compilation cold and cached, a fresh matcher's first
    mask (medians of `repeats`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    so = StructuredOutputsParams(json=SCHEMA)
    timings = {"check_ms": [], "compile_cold_ms": [], "compile_cached_ms": [], "first_mask_ms": []}
    for _ in range(repeats):
        backend = GrammarBackend(tokenizer, 4096, [1])
        backend.compile(StructuredOutputsParams(regex="x")).result()  # llguidance's tokenizer made
        start = time.perf_counter()
        check(so)
        timings["check_ms"].append(time.perf_counter() - start)
        start = time.perf_counter()
        template = backend.compile(so).result()
        timings["compile_cold_ms"].append(time.perf_counter() - start)
        start = time.perf_counter()
        backend.compile(so).result()
        timings["compile_cached_ms"].append(time.perf_counter() - start)
        mask = llguidance.numpy.allocate_token_bitmask(1, 4096)
        start = time.perf_counter()
        llguidance.numpy.fill_next_token_bitmask(template.deep_copy(), mask)
        timings["first_mask_ms"].append(time.perf_counter() - start)
        backend.close()
    out = {name: round(1000 * statistics.median(values), 3) for name, values in timings.items()}
    print(json.dumps(out), flush=True)
    return out


def markdown(result: dict) -> str:
    lines = [
        "| batch | unconstrained tok/s | JSON schema tok/s | throughput ratio | TPOT unconstrained ms | "
        "TPOT JSON ms | TPOT ratio | unconstrained, single async steps tok/s | JSON vs that | "
        "unconstrained, single sync steps tok/s | JSON vs that | mask fill ms/step | valid | "
        "JSON + grammar speculation tok/s | vs unconstrained | its tokens per step (JSON's) | proposals kept | "
        "JSON overlapped tok/s | JSON vs that |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        u, j, sp = r["unconstrained"], r["json_schema"], r["json_schema_speculation"]
        counters = r["speculation_counters"]
        s, ss = r["unconstrained_single_async_steps"], r["unconstrained_single_sync_steps"]
        lines.append(
            f"| {r['batch']} | {u['tokens_per_s']} | {j['tokens_per_s']} | {r['throughput_ratio']:.2f}x | "
            f"{u['tpot_ms']} | {j['tpot_ms']} | {r['tpot_ratio']:.2f}x | {s['tokens_per_s']} | "
            f"{r['grammar_only_throughput_ratio']:.2f}x | {ss['tokens_per_s']} | "
            f"{r['vs_single_sync_throughput_ratio']:.2f}x | {j['mask_fill_ms_per_step']} | {j['valid_fraction']:.0%} | "
            f"{sp['tokens_per_s']} ({sp['valid_fraction']:.0%} valid) | {r['speculation_throughput_ratio']:.2f}x | "
            f"{sp['output_tokens'] / sp['steps']:.2f} ({j['output_tokens'] / j['steps']:.2f}) | "
            f"{counters['spec_decode_num_accepted_tokens']} of "
            f"{counters['spec_decode_num_draft_tokens']} | {r['json_schema_overlapped']['tokens_per_s']} | "
            f"{r['vs_overlapped_throughput_ratio']:.2f}x |"
        )
    c = result["compile"]
    lines += [
        "",
        f"Schema check {c['check_ms']} ms; compile cold {c['compile_cold_ms']} ms, cached {c['compile_cached_ms']} ms; "
        f"a fresh matcher's first mask {c['first_mask_ms']} ms (medians).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--output", help="write the results as JSON (and markdown beside it)")
    args = parser.parse_args()
    result = {"compile": compile_times(), "rows": []}
    for batch in args.batches:
        result["rows"].append(measure(batch))
        if args.output:  # after every row: a slow one never costs the others
            save_results(args.output, result, markdown(result))


if __name__ == "__main__":
    main()
