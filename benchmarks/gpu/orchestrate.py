"""What the one-call GPU run scripts (`gpu_run.py`, `quantization_gpu.py`, `speculative_gpu.py`)
share: their common flags, the device probe (in a process of its own, so the orchestrator never
holds the GPU), the children's environment, the console tee, and the run itself: probe, refuse
unless JAX's platform is gpu (or --smoke), run the stages in order with budgets that add up, and
rewrite the summary after every stage.

Each script brings its own stage table (STAGE_BUDGETS_S), plan, stage runners and summary writer.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable

from benchmarks.gpu.plan import PROBE_TIMEOUT_S, ROOT, SMOKE_XLA_FLAGS
from benchmarks.gpu.runner import progress

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


def add_run_args(
    parser: argparse.ArgumentParser, stage_budgets: dict, out_default: str, work_dir_help: str, stages_help: str = ""
) -> None:
    """The flags every run script takes: --out, --work-dir, --smoke, --stages, --budget."""
    parser.add_argument(
        "--out", default=out_default, help="where summary.json, summary.md, console.txt and stages.tar.gz go"
    )
    parser.add_argument("--work-dir", help=work_dir_help)
    parser.add_argument("--smoke", action="store_true", help="the demo model and tiny shapes on the CPU")
    parser.add_argument(
        "--stages", type=lambda t: t.split(","), help=f"run only these ({','.join(stage_budgets)}{stages_help})"
    )
    parser.add_argument(
        "--budget",
        type=budget_type(stage_budgets),
        action="append",
        default=[],
        metavar="STAGE=SECONDS",
        help="override a stage's budget",
    )


def check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace, stage_budgets: dict) -> None:
    """Refuses (parser.error) unknown --stages and a --work-dir that holds files already."""
    unknown = set(args.stages or ()) - set(stage_budgets)
    if unknown:
        parser.error(f"--stages: unknown {', '.join(sorted(unknown))}; choose from {', '.join(stage_budgets)}")
    if args.work_dir and os.path.isdir(args.work_dir) and os.listdir(args.work_dir):
        parser.error(f"--work-dir {args.work_dir} is not empty: its files would be packed with this run's")


def chosen_stages(args: argparse.Namespace, stage_budgets: dict) -> list[str]:
    """The stages to run, in the table's order: all of them, or those --stages names."""
    return [name for name in stage_budgets if not args.stages or name in args.stages]


def run_stage_loop(
    chosen: list[str],
    plan,
    work_dir: str,
    env: dict,
    stage_cls,
    run_one: Callable,
    summarize: Callable[[list[dict]], None],
) -> list[dict]:
    """Runs the chosen stages in order, each a `stage_cls(name, plan, work_dir, deadline, env)` handed
    to `run_one(name, stage)`. The budgets add up: what a stage leaves unused goes to the next. An
    error of the orchestrator's own in one stage is recorded as that stage's failure and the next
    runs. After every stage `summarize(records)` rewrites the summary; returns the records."""
    records, deadline = [], time.monotonic()
    for name in chosen:
        deadline += plan.budgets_s[name]
        stage = stage_cls(name, plan, work_dir, deadline, env)
        progress(f"=== stage {name}: up to {stage.remaining():.0f} s ===")
        try:
            run_one(name, stage)
        except Exception as err:  # noqa: BLE001 - the orchestrator's own error in one stage must not end the run
            stage.fail("orchestrator", f"{type(err).__name__}: {err}")
        stage.save()
        records.append(stage.record())
        progress(f"=== stage {name}: {stage.status()} after {records[-1]['elapsed_s']:.0f} s ===")
        summarize(records)
    return records


def orchestrate(
    args: argparse.Namespace,
    work_prefix: str,
    make_plan: Callable,
    run_stages: Callable,
    write_summary: Callable,
    stage_width: int,
    headline_text: Callable = str,
) -> int:
    """A whole run: makes OUT and the work directory (a fresh temporary one named `work_prefix...`
    without --work-dir), tees the console to OUT/console.txt, plans (`make_plan(budget overrides)`),
    probes the device and refuses (exit 2, with a summary saying why) unless JAX's platform is gpu
    or this is --smoke; then `run_stages(args, plan, out_dir, work_dir, device, env)` and one line per
    stage (name padded to `stage_width`, `headline_text(headline)`). Exit 0 when every stage is ok, else 1."""
    out_dir = os.path.abspath(args.out)
    work_dir = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix=work_prefix))
    os.makedirs(out_dir, exist_ok=True)
    os.makedirs(work_dir, exist_ok=True)
    sys.stdout = Tee(os.path.join(out_dir, "console.txt"))
    plan = make_plan(dict(args.budget))
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
        progress(
            f"{record['stage']:<{stage_width}} {record['status']:<9} {record['elapsed_s']:6.0f} s  "
            f"{headline_text(record['headline'])}"
        )
    progress(f"wrote {out_dir}/summary.md, summary.json, stages.tar.gz, console.txt")
    return 0 if all(r["status"] == "ok" for r in records) else 1
