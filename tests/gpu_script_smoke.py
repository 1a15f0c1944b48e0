"""What the tests of the one-call GPU run scripts (`benchmarks/quantization_gpu.py`,
`benchmarks/speculative_gpu.py`) share: running a script in a process of its own with JAX on the
CPU (`python -m benchmarks.NAME` from the repository's root), and a module-scoped fixture holding one `--smoke` run (OUT, the work directory, summary.json).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(script: str, *argv: str, timeout: float) -> subprocess.CompletedProcess:
    """Runs the module benchmarks.`script` with `argv`, JAX on the CPU, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{script}", *argv],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def smoke_run_fixture(script: str, timeout: float):
    """A module-scoped fixture: one `script --smoke` run into fresh directories, which must exit 0;
    it yields (out, work, summary) with summary.json parsed."""

    @pytest.fixture(scope="module")
    def smoke_run(tmp_path_factory):
        out, work = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("work") / "stages"
        proc = run_script(script, "--smoke", "--out", str(out), "--work-dir", str(work), timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
        return out, work, json.loads((out / "summary.json").read_text())

    return smoke_run
