"""The code is formatted and linted as pyproject.toml's `[tool.ruff]` says (`ruff format`,
`ruff check`: pyflakes, pycodestyle's errors, import order). Fix with
`ruff format . && ruff check --fix .` from the repository root."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATHS = ("jaxpaged", "pallas_kernels", "tests", "benchmarks", "examples", "convert")


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "check"])
def test_ruff(command):
    result = subprocess.run([sys.executable, "-m", "ruff", *command, *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"ruff {' '.join(command)}:\n{result.stdout[-6000:]}{result.stderr[-2000:]}"
