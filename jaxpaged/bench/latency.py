"""`jaxpaged bench latency`: end-to-end latency of one fixed batch (vLLM's `bench latency`).

    jaxpaged bench latency --input-len 32 --output-len 128 --batch-size 1 --num-iters 30

`--batch-size` prompts of `--input-len` random token ids each generate `--output-len` tokens
(temperature 1, EOS ignored), `--num-iters-warmup` times untimed, then `--num-iters` times
timed. Reports the mean, standard deviation and percentiles of the batch's latency and the
mean time per output token (latency / output length, prefill included). Prefix caching is off
by default, as in vLLM: every iteration repeats the same prompts.
"""

import argparse
import dataclasses
import json
import random
import time

import numpy as np

from jaxpaged.checkpoint.format import tokenizer_dir
from jaxpaged.config.presets import load_config_dict
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR, engine_args, engine_config
from jaxpaged.entrypoints.cli_generate import size_to_job
from jaxpaged.sampling_params import SamplingParams

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_latency_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `bench latency` beyond the engine's (vLLM's names)."""
    parser.add_argument("--input-len", type=int, default=32, metavar="N", help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, metavar="N", help="tokens generated per prompt")
    parser.add_argument("--batch-size", type=int, default=1, metavar="N", help="prompts generated together")
    parser.add_argument("--num-iters-warmup", type=int, default=10, metavar="N", help="untimed iterations first")
    parser.add_argument("--num-iters", type=int, default=30, metavar="N", help="timed iterations")
    parser.add_argument("--output-json", metavar="FILE", help="write the result here")


def run(args: argparse.Namespace) -> int:
    """`jaxpaged bench latency` with parsed arguments."""
    for flag, value, minimum in (
        ("--input-len", args.input_len, 1),
        ("--output-len", args.output_len, 1),
        ("--batch-size", args.batch_size, 1),
        ("--num-iters-warmup", args.num_iters_warmup, 0),
        ("--num-iters", args.num_iters, 1),
    ):
        if value < minimum:
            raise ValueError(f"{flag} {value}: must be at least {minimum}")
    model = args.model or DEMO_MODEL_DIR
    _, config = load_config_dict(model)
    rng = random.Random(args.seed)
    prompts = [
        {"prompt_token_ids": [rng.randrange(config["vocab_size"]) for _ in range(args.input_len)]}
        for _ in range(args.batch_size)
    ]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.output_len, ignore_eos=True)
    placeholder = {} if args.max_num_seqs is not None else dict(max_num_seqs=1)
    skip = args.skip_tokenizer_init or tokenizer_dir(model, args.tokenizer) is None
    checked = engine_config(
        args, skip_tokenizer_init=skip, **placeholder
    )  # every engine flag checked before anything slow
    sizes = size_to_job(args, checked.model, prompts, [params] * len(prompts))
    engine = engine_args(args, **sizes, skip_tokenizer_init=skip, seed=checked.load.seed)

    from jaxpaged.entrypoints.llm import LLM  # JAX is imported from here on

    llm = LLM(**dataclasses.asdict(engine))

    def one_batch() -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
        return seconds

    for _ in range(args.num_iters_warmup):
        one_batch()
    latencies = np.array([one_batch() for _ in range(args.num_iters)])
    result = {
        "model": model,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "batch_size": args.batch_size,
        "avg_latency": float(latencies.mean()),
        "std_latency": float(latencies.std()),
        "latencies": latencies.tolist(),
        "percentiles": {str(p): float(np.percentile(latencies, p)) for p in PERCENTILES},
        "avg_time_per_output_token_ms": float(latencies.mean()) / args.output_len * 1000,
    }
    print(f"Avg latency: {result['avg_latency']:.4f} seconds")
    print(f"Std latency: {result['std_latency']:.4f} seconds")
    for p, value in result["percentiles"].items():
        print(f"{p}% percentile latency: {value:.4f} seconds")
    print(f"Avg time per output token: {result['avg_time_per_output_token_ms']:.2f} ms")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
