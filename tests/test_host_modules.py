"""Host-side modules import no JAX (DESIGN.md §2): they stay plain Python/numpy."""

import subprocess
import sys

HOST_MODULES = [
    "jaxpaged.block_manager", "jaxpaged.scheduler", "jaxpaged.sequence", "jaxpaged.sampling_params",
    "jaxpaged.step_inputs", "jaxpaged.step_packer", "jaxpaged.detokenizer", "jaxpaged.memory",
    "jaxpaged.outputs", "jaxpaged.config",
]  # fmt: skip


def test_host_modules_do_not_import_jax():
    code = f"import sys\nfor m in {HOST_MODULES!r}: __import__(m)\nprint(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"host modules pulled in: {out}"
