"""Where `jaxpaged bench throughput`'s time goes, step by step: runs the command in this process
with the engine's step, the runner's packing and its result reads timed, and prints (and writes)
per step program: steps, milliseconds per step, the part spent waiting for the device, and the
real tokens and sequences per step (the rest of the program's bucket is padding).

    python -m benchmarks.throughput_steps --output FILE -- bench throughput --dataset-name sharegpt \\
        --num-prompts 200 --max-model-len 512 --dtype float32

Everything after `--` is `jaxpaged`'s command line. Results: benchmarks/results/throughput_cpu_demo_sharegpt_steps.json.
"""

import argparse
import collections
import json
import sys

from benchmarks.call_timing import time_calls
from jaxpaged.cli import main as jaxpaged_main
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.worker.model_runner import ModelRunner


def instrument() -> list[dict]:
    """Wraps `LLMEngine.step`, `ModelRunner._pack` and `ModelRunner.fetch`; returns the list each
    step's record is appended to."""
    records, current = [], {}
    time_calls(LLMEngine, "step", lambda s: current.update(wall_s=s))
    time_calls(ModelRunner, "fetch", lambda s: current.update(wait_s=current["wait_s"] + s))
    step, pack = LLMEngine.step, ModelRunner._pack

    def recorded_step(self):
        current.clear()
        current["wait_s"] = 0.0
        outputs = step(self)
        records.append(dict(current))
        return outputs

    def recorded_pack(self, inputs, prepared, steps, *rest):
        packed = pack(self, inputs, prepared, steps, *rest)
        program = packed[0]
        current["program"] = f"{'decode' if program.decode else 'mixed'} {program.tokens} tokens x {program.steps}"
        current["tokens"] = sum(len(s.token_ids) for s in inputs)
        current["seqs"] = len(inputs)
        return packed

    LLMEngine.step, ModelRunner._pack = recorded_step, recorded_pack
    return records


def summarize(records: list[dict]) -> dict:
    """Per program: steps, ms per step, wait ms per step, real tokens and sequences per step."""
    groups = collections.defaultdict(list)
    for r in records:
        groups[r.get("program", "no program (nothing to run)")].append(r)
    rows = []
    for program, rs in sorted(groups.items(), key=lambda g: -sum(r["wall_s"] for r in g[1])):
        n = len(rs)
        rows.append(
            {
                "program": program,
                "steps": n,
                "seconds": round(sum(r["wall_s"] for r in rs), 2),
                "ms_per_step": round(1000 * sum(r["wall_s"] for r in rs) / n, 1),
                "wait_ms_per_step": round(1000 * sum(r["wait_s"] for r in rs) / n, 1),
                "tokens_per_step": round(sum(r.get("tokens", 0) for r in rs) / n, 1),
                "seqs_per_step": round(sum(r.get("seqs", 0) for r in rs) / n, 1),
            }
        )
    total = sum(r["wall_s"] for r in records)
    wait = sum(r["wait_s"] for r in records)
    return {"steps": len(records), "step_seconds": round(total, 2), "wait_seconds": round(wait, 2), "programs": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", help="write the summary (with the command line) here as JSON")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- and jaxpaged's command line")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    records = instrument()
    try:
        code = jaxpaged_main(command)
    except SystemExit as exit_:
        code = exit_.code
    summary = {"command": ["jaxpaged", *command], **summarize(records)}
    print(
        f"{summary['steps']} steps, {summary['step_seconds']} s in step(), {summary['wait_seconds']} s of it waiting "
        "for the device"
    )
    for row in summary["programs"]:
        print("  " + ", ".join(f"{k} {v}" for k, v in row.items()))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(summary, f, indent=1)
    return code or 0


if __name__ == "__main__":
    sys.exit(main())
