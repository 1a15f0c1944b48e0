"""Offline throughput: jaxpaged's `LLM.generate` vs Hugging Face transformers' batched `generate`.

Both run the same random prompts with the same output length (greedy, EOS ignored), in the
same process, on the same machine; compilation and warm-up are excluded from both timings.

    python benchmarks/throughput.py [--model DIR] [--num-prompts 64] [--input-len 32,128]
                                    [--output-len 64] [--hf-batch-size 16] [--json out.json]
"""

import argparse
import json
import os
import sys
import time

import numpy as np

from jaxpaged.cli import DEMO_MODEL_DIR
from jaxpaged.llm import LLM
from jaxpaged.sampling_params import SamplingParams


def run_jaxpaged(model_dir: str, prompts: list[list[int]], output_len: int, args) -> float:
    llm = LLM(model_dir, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return seconds


def run_transformers(model_dir: str, prompts: list[list[int]], output_len: int, args) -> float:
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None

    def batch_generate(batch):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                                 min_new_tokens=output_len, pad_token_id=0)  # fmt: skip
        assert out.shape[1] == width + output_len

    batch_generate(prompts[:2])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch_size):
        batch_generate(prompts[i : i + args.hf_batch_size])
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEMO_MODEL_DIR)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="32,128", help="min,max prompt tokens")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)

    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    lo, hi = map(int, args.input_len.split(","))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(args.num_prompts)]
    generated = args.num_prompts * args.output_len

    ours = run_jaxpaged(args.model, prompts, args.output_len, args)
    theirs = run_transformers(args.model, prompts, args.output_len, args)
    result = {
        "model": os.path.basename(os.path.normpath(args.model)), "dtype": args.dtype,
        "num_prompts": args.num_prompts, "input_len": [lo, hi], "output_len": args.output_len,
        "jaxpaged_seconds": ours, "transformers_seconds": theirs,
        "jaxpaged_tokens_per_s": generated / ours, "transformers_tokens_per_s": generated / theirs,
        "speedup": theirs / ours, "transformers_batch_size": args.hf_batch_size,
    }  # fmt: skip
    print(f"{'engine':14s} {'seconds':>9s} {'gen tok/s':>10s}")
    print(f"{'jaxpaged':14s} {ours:9.2f} {generated / ours:10.1f}")
    print(f"{'transformers':14s} {theirs:9.2f} {generated / theirs:10.1f}")
    print(f"jaxpaged / transformers throughput = {theirs / ours:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
