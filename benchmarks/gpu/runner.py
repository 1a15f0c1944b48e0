"""One step of a stage: a command in a process group of its own, with a timeout.

Its output is teed line by line to the console (each line stamped with the UTC time and the
step's name) and to the stage's log. On timeout the whole group is stopped (SIGTERM, then
SIGKILL), so a server or a compile worker it started goes with it; the step then counts as
timed out and keeps the output it printed and the files it wrote.
"""

import dataclasses
import os
import shlex
import signal
import subprocess
import threading
import time


def stamp() -> str:
    """The UTC wall-clock time, HH:MM:SS."""
    return time.strftime("%H:%M:%S", time.gmtime())


def progress(message: str) -> None:
    """A timestamped progress line on the console."""
    print(f"[{stamp()}] {message}", flush=True)


@dataclasses.dataclass
class StepOutcome:
    """How a step ended: `status` is ok, failed (non-zero exit) or timed_out."""

    status: str
    returncode: int | None
    elapsed_s: float


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's process group; SIGKILL to the group once the step's own process has
    exited, or 10 s later."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    except ProcessLookupError:  # the whole group is gone already
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_step(label: str, cmd: list[str], timeout_s: float, log_path: str, env: dict) -> StepOutcome:
    """Runs `cmd` for at most `timeout_s` seconds, teeing its output to the console and `log_path`."""
    start = time.monotonic()
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(f"[{stamp()}] $ {shlex.join(cmd)}  (timeout {timeout_s:.0f} s)\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
            start_new_session=True,
        )

        def tee() -> None:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                print(f"[{stamp()} {label}] {line.rstrip()}", flush=True)

        reader = threading.Thread(target=tee, daemon=True)
        reader.start()
        try:
            returncode = proc.wait(timeout=max(timeout_s, 0.1))
            status = "ok" if returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            returncode, status = None, "timed_out"
        _stop_group(proc)  # also what a finished step left running
        proc.wait()
        reader.join(timeout=10)
        elapsed = time.monotonic() - start
        log.write(f"[{stamp()}] {label}: {status} (exit {returncode}) after {elapsed:.1f} s\n")
    return StepOutcome(status, returncode, elapsed)
