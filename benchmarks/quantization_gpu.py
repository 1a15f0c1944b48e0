"""What a lent GPU should measure about quantization, in one device call of at most 10 minutes.

    bash benchmarks/run_gpu.sh quantization "$OUT"              # on the GPU machine (this script, --out "$OUT")
    python -m benchmarks.quantization_gpu --smoke --out /tmp/q  # the whole run on a CPU: demo model, tiny shapes

Nothing needs preparing or carrying: the 8B engines use dummy weights and random prompts.
The stages below, with this plan, run by the stage runner all GPU runs share (`gpu/orchestrate.py`,
as for `gpu_run.py`): the device is probed in a process of its own; every step runs in a process
group of its own with its own timeout (the smaller of its cap and what the stage has left; a
stage's unused seconds go to the next); OUT/summary.json, OUT/summary.md (`gpu/quant_summary.py`)
and OUT/stages.tar.gz are rewritten after every stage; OUT/console.txt holds the timestamped console.

Stages, most valuable first (budgets in STAGE_BUDGETS_S; they and the probe sum to 9.5 minutes):

1. hlo: `gpu/quant_hlo.py` compiles the 8B engine's step programs from shapes alone, for fp8
   weights + fp8 KV, int8 weights, bf16 and fp8 with XLA's dynamic-slice fusion, and counts in
   the optimised HLO (`gpu/hlo_census.py`) the GEMM custom calls (cuBLASLt's fp8 GEMM is
   `__cublas$lt$matmul$f8`), the GEMM fusions and the dtypes their dots take, and every
   weight-sized buffer written to memory: upcasts of a float8/int8 weight, 8-bit transposes or
   copies of one, per-layer slices copied out of the stacked weights. The HLO text goes in the
   tarball.
2. kernels: `gpu/quant_kernels.py`: the decode kernel over a float8_e4m3fn pool with scales vs a
   bf16 pool (Llama-8B attention shapes, batches x contexts, interpret=False): µs, GB/s over the
   bytes read, fp8/bf16 time; correctness of the decode and ragged kernels over float8 pools
   with NaN-poisoned unowned slots against the reference.
3. engine: `jaxpaged bench latency` (batch 1, TPOT) then `jaxpaged bench throughput` (random
   prompts, fixed lengths) for bf16, fp8 weights + fp8 KV, fp8 KV, int8 weights, int4 weights (RTN at load), each a process
   of its own, all with the same engine limits and one persistent compilation cache in the work
   directory (a mode's throughput run loads the programs its latency run compiled); ratios to bf16.
"""

import dataclasses
import shutil
import sys

from benchmarks.gpu.orchestrate import GpuRun, main
from benchmarks.gpu.plan import (
    DEMO_MODEL_DIR,
    GPU_ENGINE_LIMITS,
    GPU_MODEL,
    GPU_WEIGHT_FLAGS,
    SCANNED_IN_PLACE,
    SMOKE_DUMMY_WEIGHT_FLAGS,
    SMOKE_ENGINE_LIMITS,
    Plan,
)
from benchmarks.gpu.quant_summary import SUMMARY
from benchmarks.gpu.stage import CLI, Stage

# Seconds per stage; with the device probe (at most PROBE_TIMEOUT_S) they sum to 9.5 minutes.
STAGE_BUDGETS_S = {"hlo": 120, "kernels": 90, "engine": 340}
SMOKE_STAGE_BUDGET_S = 120
# The engine modes, most valuable first: the flags each adds to the bf16 engine's.
ENGINE_MODES = {
    "bf16": (),
    "fp8_w_kv": ("--quantization", "fp8", "--kv-cache-dtype", "fp8"),
    "fp8_kv": ("--kv-cache-dtype", "fp8"),
    "int8": ("--quantization", "int8"),
    # Round-to-nearest int4 at load (group size 128): decode runs the group-quantized Pallas GEMM.
    "int4": ("--quantization", "int4"),
}
# The HLO steps: (name, engine flags, programs, extra XLA flag).
HLO_STEPS = (
    ("fp8", ("--quantization", "fp8", "--kv-cache-dtype", "fp8"), "decode:16,decode:256,mixed:2048", None),
    ("int8", ("--quantization", "int8"), "decode:16,mixed:2048", None),
    ("bf16", (), "decode:16", None),
    (
        "fp8_scanned_cublas_in_place",
        ("--quantization", "fp8", "--kv-cache-dtype", "fp8", "--scan-layers"),
        "decode:16",
        SCANNED_IN_PLACE,
    ),
)


@dataclasses.dataclass(frozen=True)
class QuantPlan(Plan):
    """Everything the stages need to build their commands."""

    hlo_programs: dict  # HLO step name -> programs (overrides HLO_STEPS' under --smoke)
    kernel_flags: tuple[str, ...]
    latency_flags: tuple[str, ...]
    throughput_flags: tuple[str, ...]
    caps_s: dict  # per-step caps: hlo step name, "kernels", "latency", "throughput"
    mode_flags: dict = dataclasses.field(default_factory=dict)  # engine mode -> flags added to ENGINE_MODES'


def gpu_plan(budgets: dict) -> QuantPlan:
    """Llama-3.1-8B's shapes with dummy bf16 weights (quantized at init where asked), on the GPU.
    The engine limits are gpu_run.py's, so its bf16 engine compiles the same programs."""
    return QuantPlan(
        smoke=False,
        model=GPU_MODEL,
        weight_flags=GPU_WEIGHT_FLAGS,
        engine_limits=GPU_ENGINE_LIMITS,
        budgets_s={**STAGE_BUDGETS_S, **budgets},
        hlo_programs={name: programs for name, _, programs, _ in HLO_STEPS},
        kernel_flags=(),
        latency_flags=(
            "--batch-size",
            "1",
            "--input-len",
            "32",
            "--output-len",
            "128",
            "--num-iters-warmup",
            "2",
            "--num-iters",
            "5",
        ),
        throughput_flags=(
            "--dataset-name",
            "random",
            "--num-prompts",
            "256",
            "--input-len",
            "512",
            "--output-len",
            "128",
        ),
        # A cold 8B engine (probe + 14 programs) compiles in tens of seconds; a warm one loads them.
        caps_s={"fp8": 75, "int8": 45, "bf16": 30, "fp8_scanned_cublas_in_place": 30, "latency": 110, "throughput": 80},
    )


def smoke_plan(budgets: dict) -> QuantPlan:
    """The demo model, tiny limits and workloads, kernels in interpret mode: the whole run on a CPU."""
    return QuantPlan(
        smoke=True,
        model=DEMO_MODEL_DIR,
        weight_flags=SMOKE_DUMMY_WEIGHT_FLAGS,
        engine_limits=SMOKE_ENGINE_LIMITS,
        budgets_s={**dict.fromkeys(STAGE_BUDGETS_S, SMOKE_STAGE_BUDGET_S), **budgets},
        hlo_programs={name: "decode:1" for name, *_ in HLO_STEPS},
        kernel_flags=("--smoke",),
        latency_flags=("--input-len", "8", "--output-len", "4", "--num-iters-warmup", "0", "--num-iters", "1"),
        throughput_flags=("--dataset-name", "random", "--num-prompts", "2", "--input-len", "8", "--output-len", "4"),
        caps_s={},
        # The demo model's FFN width (704) is no multiple of int4's default group of 128 inputs.
        mode_flags={"int4": ("--quantization-group-size", "64")},
    )


def run_hlo(stage: Stage) -> None:
    plan = stage.plan
    hlo_dir = stage.path("hlo")
    for name, flags, _, xla_flag in HLO_STEPS:
        out = stage.path(f"hlo_{name}.json")
        cmd = [
            *stage.with_xla_flag(xla_flag),
            sys.executable,
            "-m",
            "benchmarks.gpu.quant_hlo",
            "--model",
            plan.model,
            *plan.weight_flags,
            *flags,
            *plan.engine_limits,
            "--programs",
            plan.hlo_programs[name],
            "--label",
            name,
            "--hlo-dir",
            hlo_dir,
            "--output-json",
            out,
        ]
        stage.step(name, cmd, out, plan.caps_s.get(name))


def run_kernels(stage: Stage) -> None:
    out = stage.path("quant_kernels.json")
    stage.step(
        "fp8_vs_bf16",
        [sys.executable, "-m", "benchmarks.gpu.quant_kernels", *stage.plan.kernel_flags, "--out", out],
        out,
    )


def run_engine(stage: Stage, modes: list[str]) -> None:
    plan = stage.plan
    cache = stage.path("engine_xla_cache")
    shutil.rmtree(cache, ignore_errors=True)
    base = [*plan.weight_flags, *plan.engine_limits, "--compilation-cache-dir", cache]
    for mode in modes:
        flags = (*ENGINE_MODES[mode], *plan.mode_flags.get(mode, ()))
        out = stage.path(f"latency_{mode}.json")
        stage.step(
            f"latency_{mode}",
            [*CLI, "bench", "latency", "--model", plan.model, *base, *flags, *plan.latency_flags, "--output-json", out],
            out,
            plan.caps_s.get("latency"),
        )
        out = stage.path(f"throughput_{mode}.json")
        stage.step(
            f"throughput_{mode}",
            [
                *CLI,
                "bench",
                "throughput",
                "--model",
                plan.model,
                *base,
                *flags,
                *plan.throughput_flags,
                "--disable-tqdm",
                "--output-json",
                out,
            ],
            out,
            plan.caps_s.get("throughput"),
        )


def plan_info(args, plan: QuantPlan, chosen: list[str]) -> dict:
    return {
        "engine_modes": {
            mode: " ".join((*ENGINE_MODES[mode], *plan.mode_flags.get(mode, ()))) or "(bf16)"
            for mode in args.engine_modes
        },
        "latency_flags": plan.latency_flags,
        "throughput_flags": plan.throughput_flags,
        "caps_s": plan.caps_s,
    }


def add_args(parser) -> None:
    parser.add_argument(
        "--engine-modes",
        type=lambda t: t.split(","),
        default=list(ENGINE_MODES),
        help=f"the engine stage's modes, in order (default {','.join(ENGINE_MODES)}; bf16 is the ratios' base)",
    )


def check_engine_modes(parser, args) -> None:
    if set(args.engine_modes) - set(ENGINE_MODES):
        parser.error(f"--engine-modes: choose from {', '.join(ENGINE_MODES)}")


RUN = GpuRun(
    description=__doc__,
    results_name="quantization_gpu_run",
    work_prefix="jaxpaged_quant_gpu_",
    stage_budgets=STAGE_BUDGETS_S,
    gpu_plan=gpu_plan,
    smoke_plan=smoke_plan,
    stage_runners=lambda args: {
        "hlo": run_hlo,
        "kernels": run_kernels,
        "engine": lambda stage: run_engine(stage, args.engine_modes),
    },
    summary=SUMMARY,
    plan_info=plan_info,
    add_args=add_args,
    before_run=check_engine_modes,
)


if __name__ == "__main__":
    sys.exit(main(RUN))
