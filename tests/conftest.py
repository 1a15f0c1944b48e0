"""Test-wide setup: JAX on CPU with 8 fake devices (for sharding tests) and XLA's CPU compiler at
LLVM's -O0 (below), tiny models importable, the tiers (tests/tiers.py, applied by
tests/tiering.py: `pytest` runs the `pr` tier; `--tier slow|all`, `--shard K|auto`), a
compilation cache that outlives the run (below), and each module's compiled programs freed when
it ends. tests/gpu_compile/ is collected where the gpu-compile extra is installed (CI stage 2).

Every test runs in the pytest process (fixtures shared within a module; see tests/shared_engines.py
for engines shared by the whole session). Tests that need a fresh process start it themselves: the
CLI's start-up, several processes as one engine (tests/test_multihost.py), engine processes.
"""

import importlib.util
import os
import platform
import sys
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version

import pytest

pytest_plugins = ["tiering"]

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
# chose a level.
if not _compiles_for_gpus() and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
sys.path.insert(0, os.path.dirname(__file__))

# $XDG_CACHE_HOME points at a directory of this run (shared by its subprocesses), so that nothing
# a test writes there (the engines' default compilation cache, the disk tier's default) reaches
# the user's ~/.cache.
if "JAXPAGED_TEST_CACHE_HOME" not in os.environ:  # set once per run; subprocesses inherit it
    os.environ["JAXPAGED_TEST_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxpaged-test-cache-")
USERS_CACHE = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
os.environ["XDG_CACHE_HOME"] = os.environ["JAXPAGED_TEST_CACHE_HOME"]

# JAX's persistent compilation cache for every program the tests compile (the engines' step
# programs, the kernels in interpret mode, the references), in a directory that outlives the run
# (a second run on the same machine starts warm; CI's clean clone as well, the directory being
# outside the checkout): one per Python, JAX and jaxlib version, its files unused for
# PRUNE_DAYS removed at the start of a run. JAX's cache key covers the program, the XLA flags and
# the backend; JAXPAGED_TEST_XLA_CACHE names another directory, or "none" for no cache (a cold
# run). The environment carries it into the tests' subprocesses.
PRUNE_DAYS = 14


def _test_xla_cache() -> str | None:
    setting = os.environ.get("JAXPAGED_TEST_XLA_CACHE")
    if setting == "none":
        return None
    if setting:
        return setting
    try:
        versions = f"jax{version('jax')}-jaxlib{version('jaxlib')}"
    except PackageNotFoundError:
        versions = "nojax"
    return os.path.join(USERS_CACHE, "jaxpaged-tests", f"xla-py{platform.python_version()}-{versions}")


def _prune(directory: str, days: float) -> None:
    cutoff = time.time() - days * 86400
    for entry in os.scandir(directory):
        try:
            stat = entry.stat()
            if entry.is_file() and max(stat.st_atime, stat.st_mtime) < cutoff:
                os.remove(entry.path)
        except OSError:  # another run removed or is writing it
            pass


TEST_XLA_CACHE = _test_xla_cache()
if TEST_XLA_CACHE and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.makedirs(TEST_XLA_CACHE, exist_ok=True)
    _prune(TEST_XLA_CACHE, PRUNE_DAYS)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = TEST_XLA_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """(directory, transformers model) of the tiny random Llama (GQA 4, 512-token vocabulary)
    with its tokenizer, saved once per session: the "tiny" shared engine's model."""
    from engine_fixtures import make_model_dir

    path = str(tmp_path_factory.mktemp("tiny_model"))
    return path, make_model_dir(path)


@pytest.fixture(scope="session")
def shared_engines(request):
    """The session's canonical engines (tests/shared_engines.py)."""
    from shared_engines import SharedEngines

    engines = SharedEngines(lambda: request.getfixturevalue("tiny_model")[0])
    yield engines
    engines.close()


@pytest.fixture(scope="session")
def demo_server(shared_engines):
    """The demo server of the server test modules (tests/demo_server.py): one engine behind one
    `AsyncEngine` for the session; each module serves its own app over it."""
    from demo_server import DemoServer

    server = DemoServer(shared_engines.take("demo-server"))
    yield server
    server.close()


@pytest.fixture(autouse=True)
def _keep_the_test_compilation_cache():
    """Points JAX back at TEST_XLA_CACHE after a test that moved it: an engine started with
    `compilation_cache_dir` set ("none", a directory of the test's) sets JAX's process-wide
    cache directory, which every later compile would otherwise use."""
    yield
    jax = sys.modules.get("jax")
    if TEST_XLA_CACHE and jax is not None and jax.config.jax_compilation_cache_dir != TEST_XLA_CACHE:
        from jax.experimental.compilation_cache import compilation_cache

        jax.config.update("jax_compilation_cache_dir", TEST_XLA_CACHE)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        compilation_cache.reset_cache()


_PEAK_MAPPINGS = {"count": 0, "module": ""}
FREE_ABOVE_MAPPINGS = 25_000  # of the kernel's 65,530 a process by default; a module adds a few thousand


def _mappings() -> int:
    """This process's memory mappings (0 where /proc is missing)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs(request):
    """Frees the compiled programs when a test module ends with more than FREE_ABOVE_MAPPINGS
    memory mappings. Every CPU executable keeps its machine code in mappings of its own; held
    until the end of a full run, they exceed the kernel's limit on mappings per process
    (vm.max_map_count, 65,530 by default) and XLA's CPU compiler then crashes in the next compile
    (a segfault in `backend_compile` or in the compilation cache's serialisation). Freeing after
    every module instead cost ~0.5 s a module (a full garbage collection). The peak, taken as
    each module ends, is in the summary."""
    yield
    count = _mappings()
    if count > _PEAK_MAPPINGS["count"]:
        _PEAK_MAPPINGS.update(count=count, module=request.module.__name__)
    if count > FREE_ABOVE_MAPPINGS:
        import gc

        import jax

        jax.clear_caches()
        gc.collect()


def pytest_terminal_summary(terminalreporter):
    if _PEAK_MAPPINGS["count"]:
        try:
            with open("/proc/sys/vm/max_map_count") as f:
                limit = f.read().strip()
        except OSError:
            limit = "?"
        terminalreporter.write_line(
            f"memory mappings: peak {_PEAK_MAPPINGS['count']} (as {_PEAK_MAPPINGS['module']} ended), "
            f"the kernel's limit {limit}"
        )
