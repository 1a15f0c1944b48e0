"""Offline throughput: jaxpaged's `LLM.generate` vs Hugging Face transformers' batched `generate`.

Both run the same random prompts with the same output length (greedy, EOS ignored), in the
same process, on the same machine (transformers on CUDA when torch sees a GPU); compilation
and warm-up are excluded from both timings. `--load-format dummy` gives both engines random
weights of the model's shape; `--model` may then also be a `jaxpaged plan` preset name such
as `llama-3.1-8b` (no download, no tokenizer needed).

    python benchmarks/throughput.py [--model DIR_OR_PRESET] [--load-format auto|dummy] [--dtype bfloat16]
        [--num-prompts 64] [--input-len 32,128] [--output-len 64] [--hf-batch-size 16] [--json out.json]
"""

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from jaxpaged.config.presets import get_preset
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
from jaxpaged.sampling_params import SamplingParams


def run_jaxpaged(model_dir: str, prompts: list[list[int]], output_len: int, args, steps: int) -> float:
    from jaxpaged.entrypoints.llm import LLM  # JAX loads here, after the arguments are checked

    llm = LLM(model_dir, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, num_scheduler_steps=steps,
              load_format=args.load_format, skip_tokenizer_init=args.load_format == "dummy")  # fmt: skip
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
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.load_format == "dummy":
        config = transformers.AutoConfig.from_pretrained(model_dir)
        with torch.device(device):  # initialise on the GPU: an 8B model on the CPU takes minutes
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None

    def batch_generate(batch):
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=output_len,
                                 min_new_tokens=output_len, pad_token_id=0)  # fmt: skip
        assert out.shape[1] == width + output_len

    batch_generate(prompts[:2])  # warm-up
    start = time.perf_counter()
    for i in range(0, len(prompts), args.hf_batch_size):
        batch_generate(prompts[i : i + args.hf_batch_size])
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEMO_MODEL_DIR)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="32,128", help="min,max prompt tokens")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--num-scheduler-steps", default="1,4", help="fused decode steps to compare")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)

    if not os.path.isdir(args.model):
        preset = get_preset(args.model)
        if preset is None or args.load_format != "dummy":
            parser.error(f"--model {args.model!r}: not a directory (presets need --load-format dummy)")
        args.model = tempfile.mkdtemp(prefix="jaxpaged-preset-")
        with open(os.path.join(args.model, "config.json"), "w") as f:
            json.dump(preset, f)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    lo, hi = map(int, args.input_len.split(","))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab, size=int(rng.integers(lo, hi + 1))).tolist() for _ in range(args.num_prompts)]
    generated = args.num_prompts * args.output_len

    ours = {int(k): run_jaxpaged(args.model, prompts, args.output_len, args, int(k))
            for k in args.num_scheduler_steps.split(",")}  # fmt: skip
    theirs = run_transformers(args.model, prompts, args.output_len, args)
    result = {
        "model": os.path.basename(os.path.normpath(args.model)), "dtype": args.dtype,
        "num_prompts": args.num_prompts, "input_len": [lo, hi], "output_len": args.output_len,
        "transformers_batch_size": args.hf_batch_size, "transformers_seconds": theirs,
        "transformers_tokens_per_s": generated / theirs,
        "jaxpaged": {k: {"seconds": s, "tokens_per_s": generated / s, "speedup_vs_transformers": theirs / s}
                     for k, s in ours.items()},
    }  # fmt: skip
    print(f"{'engine':32s} {'seconds':>9s} {'gen tok/s':>10s} {'vs HF':>7s}")
    for k, s in ours.items():
        print(f"{f'jaxpaged (num_scheduler_steps={k})':32s} {s:9.2f} {generated / s:10.1f} {theirs / s:6.2f}x")
    print(f"{'transformers generate':32s} {theirs:9.2f} {generated / theirs:10.1f} {1:6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
