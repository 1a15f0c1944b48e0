"""Test-wide setup: JAX on CPU with 8 fake devices (for sharding tests), tiny models importable,
the engines' default compilation cache in a directory of this run (`$XDG_CACHE_HOME` points
there, shared by the run's subprocesses, never the user's ~/.cache), and the `isolated` marker.
tests/gpu_compile/ is collected where the gpu-compile extra is installed (CI stage 2).

`isolated` tests run in a fresh Python process of their own (`python -m pytest NODEID`). The
tensor-parallel engine tests compile many 8-device programs; at the end of the full suite, in a
process that has compiled several hundred programs before, XLA's CPU compiler crashed there
(a segfault or an abort inside `backend_compile`, twice out of two full runs, never in a run of
those tests alone), taking the whole suite down with it.
"""

import os
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(__file__))
if "JAXPAGED_TEST_CACHE_HOME" not in os.environ:  # set once per run; subprocesses inherit it
    os.environ["JAXPAGED_TEST_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxpaged-test-cache-")
os.environ["XDG_CACHE_HOME"] = os.environ["JAXPAGED_TEST_CACHE_HOME"]

IN_ISOLATION = "JAXPAGED_TEST_IN_ISOLATION"


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if pyfuncitem.get_closest_marker("isolated") is None or os.environ.get(IN_ISOLATION):
        return None
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid]
    result = subprocess.run(
        command,
        cwd=pyfuncitem.config.rootpath,
        env={**os.environ, IN_ISOLATION: "1"},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if result.returncode != 0:
        pytest.fail(
            f"{pyfuncitem.nodeid} failed in its own process:\n{result.stdout[-8000:]}\n{result.stderr[-4000:]}",
            pytrace=False,
        )
    return True


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
