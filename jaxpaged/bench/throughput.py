"""`jaxpaged bench throughput`: offline throughput of `LLM.generate` (vLLM's `bench throughput`).

    jaxpaged bench throughput --dataset-name sharegpt --num-prompts 200 [--compare-transformers]
    jaxpaged bench throughput --model llama-3.1-8b --load-format dummy --dataset-name random --input-len 512 --output-len 128

1. Check the flags, then sample the requests (`--dataset-name`) and size the engine to them
   (sequences, batched tokens, context), as `jaxpaged generate` does — before JAX loads.
2. With `--compare-transformers`, run Hugging Face transformers on the same requests first, in a
   process of its own (`hf_compare.py`) with its own timeout, so each has the device to itself.
3. Start the engine (it compiles every step shape at start-up), time one `generate` over all
   requests (sampling at temperature 1, EOS ignored, as vLLM), and report requests/s and total
   and output tokens/s, and the ratio to transformers. If transformers failed or timed out, the
   engine still runs; the result records why (`transformers_error`) and the exit code is 1.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

from jaxpaged.bench import datasets
from jaxpaged.checkpoint.format import tokenizer_dir
from jaxpaged.config.presets import load_config_dict
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR, engine_args, engine_config
from jaxpaged.entrypoints.cli_generate import size_to_job
from jaxpaged.sampling_params import SamplingParams

TORCH_DTYPES = ("float32", "bfloat16", "float16")


def add_throughput_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `bench throughput` beyond the engine's (vLLM's names)."""
    datasets.add_dataset_flags(parser, default_num_prompts=1000)
    parser.add_argument("--n", type=int, default=1, metavar="N", help="sequences generated per prompt (default: 1)")
    parser.add_argument("--output-json", metavar="FILE", help="write the result here")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument(
        "--compare-transformers",
        action="store_true",
        help="also run Hugging Face transformers on the "
        "same requests (continuous batching where installed, else batched generate) in a separate "
        "process, and report the ratio",
    )
    parser.add_argument(
        "--transformers-timeout",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="stop the transformers run after this long",
    )


def run(args: argparse.Namespace) -> int:
    """`jaxpaged bench throughput` with parsed arguments."""
    datasets.check_dataset_flags(args)
    if args.transformers_timeout <= 0:
        raise ValueError(f"--transformers-timeout {args.transformers_timeout}: must be positive")
    if args.n < 1:
        raise ValueError(f"--n {args.n}: must be at least 1")
    if args.compare_transformers and args.n > 1:
        raise ValueError(f"--compare-transformers generates one sequence per prompt; drop --n {args.n}")
    if args.compare_transformers and importlib.util.find_spec("torch") is None:
        raise ValueError(
            "--compare-transformers runs Hugging Face transformers, which needs torch: pip install torch "
            "(docs/development.md says how to get the CPU build), or drop --compare-transformers"
        )
    model = args.model or DEMO_MODEL_DIR
    skip = args.skip_tokenizer_init or tokenizer_dir(model, args.tokenizer) is None
    placeholder = {} if args.max_num_seqs is not None else dict(max_num_seqs=1)
    checked = engine_config(
        args, skip_tokenizer_init=skip, **placeholder
    )  # every engine flag checked before anything slow
    _, config = load_config_dict(model)
    context = checked.max_model_len
    tokenizer = _dataset_tokenizer(args, model, skip)
    requests = datasets.get_requests(
        args, tokenizer=tokenizer, vocab_size=config["vocab_size"], max_model_len=context, seed=args.seed
    )
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [
        SamplingParams(n=args.n, temperature=1.0, top_p=1.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    sizes = size_to_job(args, checked.model, prompts, params)
    engine = engine_args(args, **sizes, skip_tokenizer_init=skip, seed=checked.load.seed)
    theirs, their_error = None, None
    if args.compare_transformers:
        try:
            theirs = _run_transformers(args, model, config, requests, engine.max_num_seqs)
        except RuntimeError as err:  # jaxpaged still runs: its figure is not lost with theirs
            their_error = str(err)
            print(f"jaxpaged: the transformers comparison failed: {their_error}", file=sys.stderr)

    from jaxpaged.entrypoints.llm import LLM  # JAX is imported from here on

    llm = LLM(**dataclasses.asdict(engine))
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {
        "model": model,
        "dtype": engine.dtype,
        "dataset_name": args.dataset_name,
        "n": args.n,
        "engine_sizes": sizes,
        "elapsed_time": elapsed,
        "num_requests": len(outputs),
        "total_num_tokens": prompt_tokens + output_tokens,
        "total_output_tokens": output_tokens,
        "requests_per_second": len(outputs) / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
    }
    print(
        f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total tokens/s, "
        f"{result['output_tokens_per_second']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    if theirs is not None:
        result["transformers"] = theirs
        result["output_throughput_vs_transformers"] = (
            result["output_tokens_per_second"] / theirs["output_tokens_per_second"]
        )
        print(
            f"{theirs['backend']} {theirs['transformers_version']} on {theirs['device']}: "
            f"{theirs['requests_per_second']:.2f} requests/s, {theirs['output_tokens_per_second']:.2f} output tokens/s"
        )
        print(f"jaxpaged / transformers (output tokens/s): {result['output_throughput_vs_transformers']:.2f}x")
    if their_error is not None:
        result["transformers_error"] = their_error
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if their_error is None else 1


def _dataset_tokenizer(args: argparse.Namespace, model: str, skip: bool):
    """The tokenizer that counts ShareGPT tokens (see `datasets.dataset_tokenizer_dir`); for
    random and prefix prompts the model's own, if any (its special ids are left out)."""
    if args.dataset_name != "sharegpt" and skip:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(datasets.dataset_tokenizer_dir(model, args.tokenizer))


def _run_transformers(args: argparse.Namespace, model: str, config: dict, requests: list, batch_size: int) -> dict:
    """Runs `hf_compare` in a fresh process on the same requests; its result dict.

    Raises:
      ValueError: the dtype has no torch equivalent.
      RuntimeError: the run failed or timed out (with its output).
    """
    dtype = args.dtype if args.dtype != "auto" else config.get("torch_dtype") or config.get("dtype") or "float32"
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"--dtype {dtype}: transformers runs {', '.join(TORCH_DTYPES)}")
    with tempfile.TemporaryDirectory(prefix="jaxpaged-bench-") as tmp:
        model_dir = model
        if not os.path.isdir(model):  # a preset: transformers needs its config.json in a directory
            model_dir = os.path.join(tmp, "model")
            os.makedirs(model_dir)
            with open(os.path.join(model_dir, "config.json"), "w") as f:
                json.dump(config, f)
        workload, out = os.path.join(tmp, "workload.json"), os.path.join(tmp, "result.json")
        with open(workload, "w") as f:
            json.dump(
                {
                    "model": model_dir,
                    "dtype": dtype,
                    "load_format": args.load_format,
                    "max_batch_size": batch_size,
                    "prompts": [r.prompt_token_ids for r in requests],
                    "output_lens": [r.output_len for r in requests],
                },
                f,
            )
        print(
            f"running transformers on the same {len(requests)} requests (separate process, timeout "
            f"{args.transformers_timeout:g} s)...",
            file=sys.stderr,
        )
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "jaxpaged.bench.hf_compare", workload, out],
                capture_output=True,
                text=True,
                timeout=args.transformers_timeout,
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(
                f"the transformers run took more than --transformers-timeout {args.transformers_timeout:g} "
                "seconds; raise it or lower --num-prompts"
            ) from None
        if proc.returncode != 0:
            raise RuntimeError(f"the transformers run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)
