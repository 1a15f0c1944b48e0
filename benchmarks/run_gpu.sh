#!/usr/bin/env bash
# Everything a lent GPU should measure, in one device call (see benchmarks/results/README.md):
#   1. the kernels with interpret=False against their references, then their speed against
#      JAX's own paged attention and cuDNN;
#   2. end-to-end offline throughput with Llama-3.1-8B's configuration (random bf16 weights)
#      against transformers on the same GPU, with 1 and 4 fused decode steps.
# Usage on the GPU machine, from the repository root:  bash benchmarks/run_gpu.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out=${1:-${OUT:-benchmarks/results}}
mkdir -p "$out"
python3 -c 'import jax; print(jax.__version__, jax.devices())'
python3 benchmarks/kernels_gpu.py --out "$out/kernels_gpu.json" 2>&1 | tee "$out/kernels_gpu.txt"
python3 benchmarks/throughput.py --model llama-3.1-8b --load-format dummy --dtype bfloat16 \
    --num-prompts 256 --input-len 128,512 --output-len 128 --max-model-len 1024 --max-num-seqs 256 \
    --max-num-batched-tokens 2048 --hf-batch-size 64 --json "$out/throughput_llama8b.json" 2>&1 \
    | tee "$out/throughput_llama8b.txt"
