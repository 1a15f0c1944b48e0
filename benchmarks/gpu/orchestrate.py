"""The one stage runner of the one-call GPU run scripts (`gpu_run.py`, `quantization_gpu.py`,
`speculative_gpu.py`), each a `GpuRun` handed to `main`:

1. Flags every script takes (--out, --work-dir, --smoke, --stages, --budget) and its own.
2. OUT and the work directory made, the console teed to OUT/console.txt.
3. The device probed in a process of its own (the orchestrator never holds the GPU); the run
   refused (exit 2, with a summary saying why) unless JAX's platform is gpu, or under --smoke.
4. The stages run in order, each a `gpu.stage.Stage` whose steps are processes of their own with
   their own timeouts; the budgets add up (what a stage leaves unused goes to the next), so the
   run fits its 10-minute device call. A stage that crashes or runs out of time is recorded as
   such and the next one runs.
5. After every stage the summary is rewritten (`gpu.summary.Summary.write`), so a slow stage
   never costs the others' results; then one line per stage. Exit 0 when every stage is ok, else 1.
"""

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable

from benchmarks.gpu.plan import PROBE_TIMEOUT_S, ROOT, SMOKE_XLA_FLAGS, Plan
from benchmarks.gpu.runner import progress
from benchmarks.gpu.stage import Stage
from benchmarks.gpu.summary import Summary


@dataclasses.dataclass(frozen=True)
class GpuRun:
    """What one GPU run script brings to the shared runner."""

    description: str  # the script's docstring, for --help
    results_name: str  # OUT's default: benchmarks/results/<results_name>
    work_prefix: str  # the name prefix of a fresh temporary work directory
    stage_budgets: dict  # stage name -> seconds on the GPU, most valuable first
    gpu_plan: Callable[[dict], Plan]  # the plan on the GPU, from --budget's overrides
    smoke_plan: Callable[[dict], Plan]  # the plan under --smoke (on the CPU)
    stage_runners: Callable[[argparse.Namespace], dict]  # stage name -> run(stage), every stage
    summary: Summary
    # The optional parts: summary.json's plan keys of the script's own (beside Plan.info's),
    plan_info: Callable[[argparse.Namespace, Plan, list[str]], dict] | None = None
    # the script's own flags, and a check of them (parser.error) or what they ask done instead of
    # a run (then its exit code),
    add_args: Callable[[argparse.ArgumentParser], None] | None = None
    before_run: Callable[[argparse.ArgumentParser, argparse.Namespace], int | None] | None = None
    stages_help: str = ""  # and what --stages' help adds


PROBE = (
    "import json, jax; d = jax.devices()[0]; print('PROBE ' + json.dumps(dict(platform=d.platform, "
    "device_kind=d.device_kind, num_devices=jax.device_count(), jax_version=jax.__version__)))"
)


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


def budget_type(stage_budgets: dict) -> Callable[[str], tuple[str, float]]:
    """The argparse type of --budget STAGE=SECONDS, STAGE one of `stage_budgets`' names."""

    def budget(text: str) -> tuple[str, float]:
        name, _, seconds = text.partition("=")
        if name not in stage_budgets or not seconds:
            raise argparse.ArgumentTypeError(f"{text!r}: STAGE=SECONDS with STAGE one of {', '.join(stage_budgets)}")
        return name, float(seconds)

    return budget


def probe_device(env: dict) -> dict:
    """JAX's first device (from a child process) and, where there is one, nvidia-smi's GPU line."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("PROBE ")), None)  # noqa: E741
    if line is None:
        raise RuntimeError(f"the JAX device probe failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    device = json.loads(line[len("PROBE ") :])
    device["name"] = device["device_kind"]
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
        device["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
        device["name"] = device["nvidia_smi"].split(",")[0] or device["name"]
    return device


def child_env(smoke: bool) -> dict:
    """The environment of every step: unbuffered, the repository importable; under --smoke JAX on the CPU."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    if smoke:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS"), SMOKE_XLA_FLAGS) if f)
    return env


def _parser(run: GpuRun) -> argparse.ArgumentParser:
    """The flags every run script takes: --out, --work-dir, --smoke, --stages, --budget; then its own."""
    parser = argparse.ArgumentParser(description=run.description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out",
        default=os.path.join(ROOT, "benchmarks", "results", run.results_name),
        help="where summary.json, summary.md, console.txt and stages.tar.gz go",
    )
    parser.add_argument(
        "--work-dir",
        help="each stage's files and the compilation caches; new or empty (default: a fresh temporary directory)",
    )
    parser.add_argument("--smoke", action="store_true", help="the demo model and tiny shapes on the CPU")
    parser.add_argument(
        "--stages", type=lambda t: t.split(","), help=f"run only these ({','.join(run.stage_budgets)}{run.stages_help})"
    )
    parser.add_argument(
        "--budget",
        type=budget_type(run.stage_budgets),
        action="append",
        default=[],
        metavar="STAGE=SECONDS",
        help="override a stage's budget",
    )
    if run.add_args:
        run.add_args(parser)
    return parser


def main(run: GpuRun, argv: list[str] | None = None) -> int:
    """Parses the flags, refuses unknown --stages and a --work-dir that holds files already, and runs."""
    parser = _parser(run)
    args = parser.parse_args(argv)
    exit_code = run.before_run(parser, args) if run.before_run else None
    if exit_code is not None:
        return exit_code
    unknown = set(args.stages or ()) - set(run.stage_budgets)
    if unknown:
        parser.error(f"--stages: unknown {', '.join(sorted(unknown))}; choose from {', '.join(run.stage_budgets)}")
    if args.work_dir and os.path.isdir(args.work_dir) and os.listdir(args.work_dir):
        parser.error(f"--work-dir {args.work_dir} is not empty: its files would be packed with this run's")
    return orchestrate(run, args)


def run_stages(
    run: GpuRun, args: argparse.Namespace, plan: Plan, out_dir: str, work_dir: str, device: dict, env: dict
) -> list[dict]:
    """Runs the chosen stages (all, or those --stages names, in the run's order), each a `Stage`
    handed to its runner. The budgets add up: what a stage leaves unused goes to the next. An error
    of the orchestrator's own in one stage is recorded as that stage's failure and the next runs.
    After every stage the summary is rewritten; returns the records."""
    chosen = [name for name in run.stage_budgets if not args.stages or name in args.stages]
    runners = run.stage_runners(args)
    plan_info = {**plan.info(chosen), **(run.plan_info(args, plan, chosen) if run.plan_info else {})}
    records, deadline = [], time.monotonic()
    for name in chosen:
        deadline += plan.budgets_s[name]
        stage = Stage(name, plan, work_dir, deadline, env)
        progress(f"=== stage {name}: up to {stage.remaining():.0f} s ===")
        try:
            runners[name](stage)
        except Exception as err:  # noqa: BLE001 - the orchestrator's own error in one stage must not end the run
            stage.fail("orchestrator", f"{type(err).__name__}: {err}")
        stage.save()
        records.append(stage.record())
        progress(f"=== stage {name}: {stage.status()} after {records[-1]['elapsed_s']:.0f} s ===")
        run.summary.write(out_dir, work_dir, device, records, plan_info)
    return records


def orchestrate(run: GpuRun, args: argparse.Namespace) -> int:
    """A whole run: makes OUT and the work directory (a fresh temporary one without --work-dir), tees
    the console to OUT/console.txt, plans, probes the device and refuses (exit 2, with a summary
    saying why) unless JAX's platform is gpu or this is --smoke; then runs the stages and prints one
    line per stage. Exit 0 when every stage is ok, else 1."""
    out_dir = os.path.abspath(args.out)
    work_dir = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix=run.work_prefix))
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(work_dir, exist_ok=True)
    sys.stdout = Tee(os.path.join(out_dir, "console.txt"))
    plan = (run.smoke_plan if args.smoke else run.gpu_plan)(dict(args.budget))
    env = child_env(args.smoke)
    progress(f"probing the device (smoke={args.smoke}); stage files in {work_dir}")
    try:
        device = probe_device(env)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        progress(f"REFUSED: {err}")
        run.summary.write(out_dir, work_dir, {"refused": True, "error": str(err)}, [], {"smoke": args.smoke})
        return 2
    progress(f"device: {device}")
    if device["platform"] != "gpu" and not args.smoke:
        progress(f"REFUSED: JAX's platform is {device['platform']}, not gpu; run on the GPU machine, or pass --smoke")
        run.summary.write(out_dir, work_dir, {**device, "refused": True}, [], {"smoke": False})
        return 2
    records = run_stages(run, args, plan, out_dir, work_dir, device, env)
    width = max(len(name) for name in run.stage_budgets) + 1
    for record in records:
        progress(
            f"{record['stage']:<{width}} {record['status']:<9} {record['elapsed_s']:6.0f} s  "
            f"{json.dumps(record['headline'])}"
        )
    progress(f"wrote {out_dir}/summary.md, summary.json, stages.tar.gz, console.txt")
    return 0 if all(r["status"] == "ok" for r in records) else 1
