#!/usr/bin/env bash
# Speculative decoding on a lent GPU, in one device call of at most 10 minutes (9.5 budgeted): the
# 8B engine's (dummy bf16 weights) batch-1 and batch-8 TPOT on repetitive prompts (a random
# 32-token phrase repeated to 512 tokens, 256 greedy output tokens), plain vs n-gram speculation
# with k=2 and k=4 (acceptance, ratios to plain), and vs a Llama-3.2-1B-shaped draft model (k=4:
# the overhead of proposing and mirroring; its dummy proposals are near-random). See
# benchmarks/speculative_gpu.py and benchmarks/results/README.md. Nothing needs carrying:
#   run(command='bash benchmarks/run_gpu_speculative.sh "$OUT"', timeout_s=600)
# $OUT comes back with summary.md, summary.json, console.txt and stages.tar.gz.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${1:-${OUT:-benchmarks/results/speculative_gpu_run}}
exec python3 -m benchmarks.speculative_gpu --out "$out" "${@:2}"
