"""What a lent GPU should measure about quantization, in one device call of at most 10 minutes.

    bash benchmarks/run_gpu_quantization.sh "$OUT"              # on the GPU machine (this script, --out "$OUT")
    python -m benchmarks.quantization_gpu --smoke --out /tmp/q  # the whole run on a CPU: demo model, tiny shapes

Nothing needs preparing or carrying: the 8B engines use dummy weights and random prompts.
Conventions as in `gpu_run.py` (whose probe, stage loop and console tee, in `gpu/orchestrate.py`, this
reuses, with `gpu/stages.Stage` and `gpu/runner`): the device is probed in a process of its own;
every step runs in a process group of its own with its own timeout (the smaller of its cap and
what the stage has left; a stage's unused seconds go to the next); OUT/summary.json,
OUT/summary.md and OUT/stages.tar.gz are rewritten after every stage; OUT/console.txt holds the
timestamped console.

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
   prompts, fixed lengths) for bf16, fp8 weights + fp8 KV, fp8 KV, int8 weights, each a process
   of its own, all with the same engine limits and one persistent compilation cache in the work
   directory (a mode's throughput run loads the programs its latency run compiled); ratios to bf16.
"""

import argparse
import dataclasses
import os
import shutil
import sys
import time

from benchmarks.gpu.orchestrate import add_run_args, check_run_args, chosen_stages, orchestrate, run_stage_loop
from benchmarks.gpu.plan import DEMO_MODEL_DIR, GPU_ENGINE_LIMITS, ROOT, SMOKE_ENGINE_LIMITS
from benchmarks.gpu.quant_summary import write_summary
from benchmarks.gpu.stages import CLI, SCANNED_IN_PLACE, Stage

# Seconds per stage; with the device probe (at most PROBE_TIMEOUT_S) they sum to 9.5 minutes.
STAGE_BUDGETS_S = {"hlo": 120, "kernels": 90, "engine": 340}
SMOKE_STAGE_BUDGET_S = 120
# The engine modes, most valuable first: the flags each adds to the bf16 engine's.
ENGINE_MODES = {
    "bf16": (),
    "fp8_w_kv": ("--quantization", "fp8", "--kv-cache-dtype", "fp8"),
    "fp8_kv": ("--kv-cache-dtype", "fp8"),
    "int8": ("--quantization", "int8"),
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
class Plan:
    """Everything the stages need to build their commands."""

    smoke: bool
    model: str
    weight_flags: tuple[str, ...]
    engine_limits: tuple[str, ...]
    hlo_programs: dict  # HLO step name -> programs (overrides HLO_STEPS' under --smoke)
    kernel_flags: tuple[str, ...]
    latency_flags: tuple[str, ...]
    throughput_flags: tuple[str, ...]
    caps_s: dict  # per-step caps: hlo step name, "kernels", "latency", "throughput"
    budgets_s: dict


def gpu_plan(budgets: dict) -> Plan:
    """Llama-3.1-8B's shapes with dummy bf16 weights (quantized at init where asked), on the GPU.
    The engine limits are gpu_run.py's, so its bf16 engine compiles the same programs."""
    return Plan(
        smoke=False,
        model="llama-3.1-8b",
        weight_flags=("--dtype", "bfloat16", "--load-format", "dummy"),
        engine_limits=GPU_ENGINE_LIMITS,
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
        budgets_s={**STAGE_BUDGETS_S, **budgets},
    )


def smoke_plan(budgets: dict) -> Plan:
    """The demo model, tiny limits and workloads, kernels in interpret mode: the whole run on a CPU."""
    return Plan(
        smoke=True,
        model=DEMO_MODEL_DIR,
        weight_flags=("--dtype", "bfloat16", "--load-format", "dummy", "--skip-tokenizer-init"),
        engine_limits=SMOKE_ENGINE_LIMITS,
        hlo_programs={name: "decode:1" for name, *_ in HLO_STEPS},
        kernel_flags=("--smoke",),
        latency_flags=("--input-len", "8", "--output-len", "4", "--num-iters-warmup", "0", "--num-iters", "1"),
        throughput_flags=("--dataset-name", "random", "--num-prompts", "2", "--input-len", "8", "--output-len", "4"),
        caps_s={},
        budgets_s={**{name: SMOKE_STAGE_BUDGET_S for name in STAGE_BUDGETS_S}, **budgets},
    )


class CappedStage(Stage):
    """A `gpu.stages.Stage` whose steps may each be capped below what the stage has left."""

    def step(self, step_name: str, cmd: list[str], output_json: str | None = None, cap_s: float | None = None) -> dict:
        deadline = self.deadline
        if cap_s is not None:
            self.deadline = min(deadline, time.monotonic() + cap_s)
        try:
            return super().step(step_name, cmd, output_json)
        finally:
            self.deadline = deadline


def with_xla_flag(stage: Stage, flag: str | None) -> list[str]:
    """An `env XLA_FLAGS=...` prefix adding `flag` to the run's XLA flags (none without a flag)."""
    if flag is None:
        return []
    return ["env", f"XLA_FLAGS={stage.env.get('XLA_FLAGS', '')} {flag}".strip()]


def run_hlo(stage: CappedStage) -> None:
    plan = stage.plan
    hlo_dir = stage.path("hlo")
    for name, flags, _, xla_flag in HLO_STEPS:
        out = stage.path(f"hlo_{name}.json")
        cmd = [
            *with_xla_flag(stage, xla_flag),
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


def run_kernels(stage: CappedStage) -> None:
    out = stage.path("quant_kernels.json")
    stage.step(
        "fp8_vs_bf16",
        [sys.executable, "-m", "benchmarks.gpu.quant_kernels", *stage.plan.kernel_flags, "--out", out],
        out,
    )


def run_engine(stage: CappedStage, modes: list[str]) -> None:
    plan = stage.plan
    cache = stage.path("engine_xla_cache")
    shutil.rmtree(cache, ignore_errors=True)
    base = [*plan.weight_flags, *plan.engine_limits, "--compilation-cache-dir", cache]
    for mode in modes:
        flags = ENGINE_MODES[mode]
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


def run_stages(args, plan: Plan, out_dir: str, work_dir: str, device: dict, env: dict) -> list[dict]:
    runners = {"hlo": run_hlo, "kernels": run_kernels, "engine": lambda stage: run_engine(stage, args.engine_modes)}
    chosen = chosen_stages(args, STAGE_BUDGETS_S)
    plan_info = {
        "smoke": plan.smoke,
        "model": plan.model,
        "engine_limits": plan.engine_limits,
        "engine_modes": {mode: " ".join(ENGINE_MODES[mode]) or "(bf16)" for mode in args.engine_modes},
        "latency_flags": plan.latency_flags,
        "throughput_flags": plan.throughput_flags,
        "budgets_s": {name: plan.budgets_s[name] for name in chosen},
        "caps_s": plan.caps_s,
    }
    return run_stage_loop(
        chosen,
        plan,
        work_dir,
        env,
        CappedStage,
        lambda name, stage: runners[name](stage),
        lambda records: write_summary(out_dir, work_dir, device, records, plan_info),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(
        parser,
        STAGE_BUDGETS_S,
        os.path.join(ROOT, "benchmarks", "results", "quantization_gpu_run"),
        "each stage's files and the compilation cache; new or empty (default: a fresh temporary directory)",
    )
    parser.add_argument(
        "--engine-modes",
        type=lambda t: t.split(","),
        default=list(ENGINE_MODES),
        help=f"the engine stage's modes, in order (default {','.join(ENGINE_MODES)}; bf16 is the ratios' base)",
    )
    args = parser.parse_args(argv)
    if set(args.engine_modes) - set(ENGINE_MODES):
        parser.error(f"--engine-modes: choose from {', '.join(ENGINE_MODES)}")
    check_run_args(parser, args, STAGE_BUDGETS_S)
    return orchestrate(
        args, "jaxpaged_quant_gpu_", smoke_plan if args.smoke else gpu_plan, run_stages, write_summary, 8
    )


if __name__ == "__main__":
    sys.exit(main())
