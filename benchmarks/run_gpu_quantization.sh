#!/usr/bin/env bash
# Quantization on a lent GPU, in one device call of at most 10 minutes (9.5 budgeted): the
# compiled HLO of the 8B step programs with fp8 / int8 weights (cuBLASLt fp8 GEMMs, or weights
# converted / re-laid out / copied first?), the decode kernel over a float8 KV pool vs a bf16
# one (GB/s, correctness with interpret=False), and the 8B engine's batch-1 TPOT and offline
# throughput with fp8 KV, fp8 weights + fp8 KV and int8 weights vs bf16. See
# benchmarks/quantization_gpu.py and benchmarks/results/README.md. Nothing needs carrying:
#   run(command='bash benchmarks/run_gpu_quantization.sh "$OUT"', timeout_s=600)
# $OUT comes back with summary.md, summary.json, console.txt and stages.tar.gz.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${1:-${OUT:-benchmarks/results/quantization_gpu_run}}
exec python3 -m benchmarks.quantization_gpu --out "$out" "${@:2}"
