"""Host-side modules import no JAX: they stay plain Python/numpy, so the scheduler, the plan and
the configuration load (and are tested) without a device runtime."""

import pkgutil
import subprocess
import sys

import jaxpaged

# Whole subpackages that must stay JAX-free (every module in them and in their subpackages,
# found from the tree).
HOST_PACKAGES = ("config", "core", "planning", "structured")
HOST_MODULES = [
    "jaxpaged",
    "jaxpaged.engine",
    "jaxpaged.sampling_params",
    "jaxpaged.outputs",
    "jaxpaged.worker.step_packer",
    "jaxpaged.checkpoint.format",
    "jaxpaged.checkpoint.hf_keys",
    "jaxpaged.parallel.sharding",
    "jaxpaged.engine_args",
    "jaxpaged.engine_config",
]


def _host_modules() -> list[str]:
    found = list(HOST_MODULES)
    for package in HOST_PACKAGES:
        path = [f"{jaxpaged.__path__[0]}/{package}"]
        found += [m.name for m in pkgutil.walk_packages(path, prefix=f"jaxpaged.{package}.")]  # subpackages too
    return found


def test_host_modules_do_not_import_jax():
    modules = _host_modules()
    assert len(modules) > len(HOST_MODULES) + 8  # the packages were found
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"host modules pulled in: {out}"
