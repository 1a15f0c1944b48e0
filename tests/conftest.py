"""Test-wide setup: JAX on CPU with 8 fake devices (for sharding tests) and XLA's CPU compiler at
LLVM's -O0 (below), tiny models importable,
the engines' default compilation cache in a directory of this run (`$XDG_CACHE_HOME` points
there, shared by the run's subprocesses, never the user's ~/.cache), and the `isolated` marker.
tests/gpu_compile/ is collected where the gpu-compile extra is installed (CI stage 2).

`isolated` tests run in a fresh Python process, one per test module: the first isolated test of
a module runs every selected isolated test of that module in one `python -m pytest NODEID...`
(the others report the outcome it recorded for them; the first one's duration is the batch's).
The tensor-parallel engine tests compile many 8-device programs; at the end of the full suite, in
a process that has compiled several hundred programs before, XLA's CPU compiler crashed there
(a segfault or an abort inside `backend_compile`, twice out of two full runs, never in a run of
those tests alone), taking the whole suite down with it. The batch's process frees its compiled
programs after every test (as a process of its own per test did); one process per test had cost
CI ~40 interpreter starts, each importing JAX, torch and transformers and rebuilding the module's
fixtures.
"""

import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()


def _compiles_for_gpus() -> bool:
    """Whether JAX's CUDA plugin is installed (tests/gpu_compile compiles for an H100: CI stage 2)."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


# XLA's CPU programs are compiled with LLVM's optimisations off (the GPU smoke runs' flag,
# benchmarks/gpu/plan.py): every engine the tests start compiles its step programs, and LLVM's
# passes were ~40% of each compile (a test file's CPU time fell by a third). What the tests check
# does not depend on it: the HLO jaxpaged emits, its memory analysis (buffers are assigned before
# LLVM runs), and tokens and logits within the tests' tolerances (without LLVM's fused
# multiply-adds a float may differ in its last bit, as it may between two CPUs). Not where the
# GPU-compile tests run, whose programs are compiled as an H100 gets them, nor where the user
# chose a level. A test whose reference is so close that a last bit matters (an fp8 rounding
# that a last-bit difference carries across a boundary) is marked `llvm_optimized`: with
# `isolated`, its module's process compiles as a user's does.
LLVM_O0 = "--xla_backend_optimization_level=0"
LLVM_OPTIMIZED = "JAXPAGED_TEST_LLVM_OPTIMIZED"  # set in the process of an `llvm_optimized` batch
if (
    not _compiles_for_gpus()
    and not os.environ.get(LLVM_OPTIMIZED)
    and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]
):
    os.environ["XLA_FLAGS"] += " " + LLVM_O0
sys.path.insert(0, os.path.dirname(__file__))
if "JAXPAGED_TEST_CACHE_HOME" not in os.environ:  # set once per run; subprocesses inherit it
    os.environ["JAXPAGED_TEST_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxpaged-test-cache-")
os.environ["XDG_CACHE_HOME"] = os.environ["JAXPAGED_TEST_CACHE_HOME"]

IN_ISOLATION = "JAXPAGED_TEST_IN_ISOLATION"
ISOLATED_REPORT = "JAXPAGED_TEST_ISOLATED_REPORT"  # the batch's process appends its reports here
_ISOLATED_BATCHES = pytest.StashKey[dict]()  # module -> the outcomes its batch recorded


def _run_isolated_batch(item) -> dict:
    """Runs every selected isolated test of `item`'s module in one fresh process; returns
    {nodeid: (outcome, report text)} for those it reported on, and "" for the process's output."""
    module = item.nodeid.split("::")[0]
    batch = [
        i.nodeid
        for i in item.session.items
        if i.nodeid.split("::")[0] == module and i.get_closest_marker("isolated") is not None
    ]
    env = {**os.environ, IN_ISOLATION: "1"}
    if any(i.get_closest_marker("llvm_optimized") for i in item.session.items if i.nodeid in batch):
        env[LLVM_OPTIMIZED] = "1"
        env["XLA_FLAGS"] = " ".join(flag for flag in env["XLA_FLAGS"].split() if flag != LLVM_O0)
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", prefix="isolated-") as report:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *batch]
        result = subprocess.run(
            command,
            cwd=item.config.rootpath,
            env={**env, ISOLATED_REPORT: report.name},
            capture_output=True,
            text=True,
            timeout=1800 * len(batch),
        )
        phases = {}  # nodeid -> [(when, outcome, text)]
        for line in report.read().splitlines():
            entry = json.loads(line)
            phases.setdefault(entry["nodeid"], []).append((entry["when"], entry["outcome"], entry["text"]))
    outcomes = {}
    for nodeid, reports in phases.items():
        bad = [r for r in reports if r[1] != "passed"]  # a failed (or skipped) phase is the test's outcome
        if bad:
            outcomes[nodeid] = bad[0][1:]
        elif {when for when, *_ in reports} == {"setup", "call", "teardown"}:
            outcomes[nodeid] = ("passed", "")
        else:  # the process died inside it
            outcomes[nodeid] = ("did not finish", "")
    outcomes[""] = (str(result.returncode), f"{result.stdout[-8000:]}\n{result.stderr[-4000:]}")
    return outcomes


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("isolated") is None or os.environ.get(IN_ISOLATION):
        return None
    batches = pyfuncitem.session.stash.setdefault(_ISOLATED_BATCHES, {})
    module = pyfuncitem.nodeid.split("::")[0]
    if module not in batches:
        batches[module] = _run_isolated_batch(pyfuncitem)
    outcomes = batches[module]
    outcome, text = outcomes.get(pyfuncitem.nodeid, ("never ran", ""))
    if outcome == "skipped":
        pytest.skip(text)
    if outcome != "passed":
        returncode, output = outcomes[""]
        pytest.fail(
            f"{pyfuncitem.nodeid} {outcome} in its module's isolated process (exit {returncode}):\n"
            f"{text[-8000:]}\n--- the process's output ---\n{output}",
            pytrace=False,
        )
    return True


def pytest_runtest_logreport(report):
    """In an isolated batch's process: records each phase's outcome for the parent."""
    path = os.environ.get(ISOLATED_REPORT)
    if path and os.environ.get(IN_ISOLATION):
        text = (
            report.longreprtext
            if report.outcome != "skipped"
            else str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
        )
        with open(path, "a") as f:
            entry = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome, "text": text}
            f.write(json.dumps(entry) + "\n")


@pytest.fixture(autouse=True)
def _isolated_tests_free_their_programs(request):
    """In an isolated batch's process: each test frees its compiled programs when it ends, as a
    process of its own per test did."""
    yield
    if os.environ.get(IN_ISOLATION) and request.node.get_closest_marker("isolated") is not None:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Frees each test module's compiled programs when it ends. Every CPU executable keeps its
    machine code in memory mappings of its own; held until the end of a full run, they exceed
    the kernel's limit on mappings per process (vm.max_map_count, 65,530 by default) and XLA's
    CPU compiler then crashes in the next compile (a segfault in `backend_compile` or in the
    compilation cache's serialisation)."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
