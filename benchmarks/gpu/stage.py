"""One stage of a GPU run: its clock, its steps and its files.

A stage runs one or more steps, every step a process of its own (`runner.run_step`) with what is
left of the stage's time (or less, where the step has a cap of its own), and leaves
`<stage>.json` (its steps, their statuses and parsed results; rewritten after every step) and
`<stage>.txt` (their output) in the work directory.
"""

import json
import os
import sys
import time

from benchmarks.gpu.runner import progress, run_step

CLI = (sys.executable, "-m", "jaxpaged.cli")


class Stage:
    """One stage's clock, steps and files. `step` runs a command with the time the stage has left."""

    def __init__(self, name: str, plan, work_dir: str, deadline: float, env: dict):
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

    def step(self, step_name: str, cmd: list[str], output_json: str | None = None, cap_s: float | None = None) -> dict:
        """Runs `cmd` for what the stage has left, or at most `cap_s` seconds (skipped when the
        stage's time is spent); its record, with the JSON it wrote."""
        record = {
            "name": step_name,
            "cmd": cmd,
            "status": "skipped",
            "returncode": None,
            "elapsed_s": 0.0,
            "result": None,
        }
        left = self.remaining() if cap_s is None else min(self.remaining(), cap_s)
        if left <= 0:
            record["error"] = "the stage's time was spent before this step"
        else:
            progress(f"{self.name}/{step_name}: starting ({left:.0f} s left in the stage)")
            outcome = run_step(f"{self.name}/{step_name}", cmd, left, self.log_path, self.env)
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

    def with_xla_flag(self, flag: str | None) -> list[str]:
        """An `env XLA_FLAGS=...` command prefix adding `flag` to the run's XLA flags (none without a flag)."""
        if flag is None:
            return []
        return ["env", f"XLA_FLAGS={self.env.get('XLA_FLAGS', '')} {flag}".strip()]
