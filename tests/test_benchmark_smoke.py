"""`benchmarks/kernels_gpu.py --smoke` runs end to end on the CPU (interpret mode, tiny shapes).

The real run needs a GPU; this keeps the script from rotting: its correctness checks, timing
loops, peers (JAX's Pallas paged attention is lowered for CUDA, not run), table and JSON.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_kernel_benchmark_smoke(tmp_path):
    out = tmp_path / "kernels.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "kernels_gpu.py"), "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["smoke"] is True
    assert results["checks"] and all(c["ok"] for c in results["checks"])
    assert results["decode"] and results["decode"][0]["ours_s"] is not None
    assert results["prefill"] and results["prefill"][0]["ours_s"] is not None
