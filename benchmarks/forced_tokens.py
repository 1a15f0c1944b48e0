"""Forced tokens without speculative decoding: JSON-schema extraction with and without them, in the
same run on the same engine.

A constrained decode computes the tokens its constraint allows alone (a schema's keys and
punctuation) as query tokens after its own and samples once after them
(`Scheduler._add_forced`); the engine without it samples every token, one step each (here: the
same engine with `_add_forced` replaced by a no-op). For each batch size one demo-model engine
(its defaults: async scheduling, fused decode steps) runs B requests constrained by the
clinical-notes schema of tests/structured_workload.py at temperature 0.8, seeded (every mode
writes the same documents, token for token: checked), in four modes: forced
tokens on and off, each with async scheduling overlapping the constrained steps too (a forced
run costs two steps: the step in flight samples its first token; the engine's default reads the
step in flight first while grammars run, like the synchronous mode) and synchronous (one step). Each mode runs twice; the run with more
tokens/s is kept. Per mode: output tokens/s, engine steps, steps per request (steps that
scheduled the request's sequence), output tokens per step, the fraction of outputs the schema
accepts; and the ratios forced / not forced.

    python -m benchmarks.forced_tokens [--batches 1 16] [--output FILE.json]

Results: benchmarks/results/forced_tokens_cpu_demo.{json,md}.
"""

import argparse
import json

from benchmarks.results_files import save_results
from benchmarks.structured_outputs import make_engine, run_once

MODES = {  # name: (forced tokens, synchronous scheduling)
    "forced": (True, False),
    "not_forced": (False, False),
    "forced_sync": (True, True),
    "not_forced_sync": (False, True),
}


def run_mode(engine, batch: int, forced: bool, sync: bool) -> dict:
    """One run of B constrained requests; adds the sequence-steps per request."""
    entries = []
    execute = engine.runner.execute
    engine.runner.execute = lambda output: (entries.append(output.num_seqs), execute(output))[1]
    if not forced:
        engine.scheduler._add_forced = lambda scheduled, forced, budget: budget
    try:
        result = run_once(engine, batch, None, [], sync=sync, seed=0, overlapped=not sync)
    finally:
        del engine.runner.execute
        engine.scheduler.__dict__.pop("_add_forced", None)
    del result["mask_fill_ms_per_step"]
    result["steps_per_request"] = round(sum(entries) / batch, 1)
    result["tokens_per_step"] = round(result["output_tokens"] / result["steps"], 2)
    return result


def measure(batch: int) -> dict:
    engine = make_engine(batch)
    run_mode(engine, min(batch, 4), True, False)  # warm-up (and the grammar compiled)
    runs = {mode: [] for mode in MODES}
    for _ in range(2):
        for mode, (forced, sync) in MODES.items():
            runs[mode].append(run_mode(engine, batch, forced, sync))
    lengths = {tuple(r["lengths"]) for mode_runs in runs.values() for r in mode_runs}
    if len(lengths) != 1:
        raise AssertionError(f"the modes wrote different documents: lengths {lengths}")
    best = {mode: max(r, key=lambda x: x["tokens_per_s"]) for mode, r in runs.items()}
    for r in best.values():
        del r["lengths"]
    row = {"batch": batch, **best}
    for suffix in ("", "_sync"):
        on, off = best["forced" + suffix], best["not_forced" + suffix]
        row["throughput_ratio" + suffix] = round(on["tokens_per_s"] / off["tokens_per_s"], 3)
        row["steps_per_request_ratio" + suffix] = round(on["steps_per_request"] / off["steps_per_request"], 3)
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| batch | scheduling | tokens/s forced / not | ratio | steps per request forced / not | ratio | "
        "tokens per step forced / not | valid |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for suffix, name in (("", "async"), ("_sync", "sync")):
            on, off = r["forced" + suffix], r["not_forced" + suffix]
            lines.append(
                f"| {r['batch']} | {name} | {on['tokens_per_s']} / {off['tokens_per_s']} | "
                f"**{r['throughput_ratio' + suffix]}x** | {on['steps_per_request']} / {off['steps_per_request']} | "
                f"{r['steps_per_request_ratio' + suffix]}x | {on['tokens_per_step']} / {off['tokens_per_step']} | "
                f"{on['valid_fraction']:.0%} / {off['valid_fraction']:.0%} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--output", default="benchmarks/results/forced_tokens_cpu_demo.json")
    args = parser.parse_args()
    rows = [measure(b) for b in args.batches]
    save_results(args.output, {"rows": rows}, table(rows))
    print(table(rows))


if __name__ == "__main__":
    main()
