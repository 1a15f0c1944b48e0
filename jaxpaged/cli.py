"""The `jaxpaged` command line.

    jaxpaged generate "In the beginning"            # the embedded demo model
    jaxpaged generate --model DIR --max-tokens 64 --temperature 0 "prompt" "another prompt"
"""

import argparse
import os
import sys

DEMO_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")


def _generate(args: argparse.Namespace) -> int:
    # Imported here so `jaxpaged --help` answers without loading JAX.
    from transformers import AutoTokenizer

    from jaxpaged.paged_generate import PagedGenerator
    from jaxpaged.weights import load_model

    model_dir = args.model or DEMO_MODEL_DIR
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config, model = load_model(model_dir, dtype=args.dtype)
    prompts = [tokenizer.encode(p) for p in args.prompts]
    for prompt, text in zip(args.prompts, prompts):
        if len(text) + args.max_tokens > config.max_context_len:
            raise ValueError(
                f"prompt of {len(text)} tokens + --max-tokens {args.max_tokens} exceeds the model's "
                f"context of {config.max_context_len} tokens; lower --max-tokens"
            )
    stop = set(config.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    generator = PagedGenerator(model, block_size=args.block_size)
    outputs = generator.generate(
        prompts, args.max_tokens, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
        stop_token_ids=sorted(stop),
    )
    for prompt, tokens in zip(args.prompts, outputs):
        print(prompt + tokenizer.decode(tokens, skip_special_tokens=True))
        print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpaged", description="PagedAttention LLM inference in JAX.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate continuations of prompts")
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--model", help="HF or converted model directory (default: the embedded demo model)")
    gen.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16 (default: auto)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy (default: 0.8)")
    gen.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens; 0 for all (default: 40)")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    gen.set_defaults(run=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxpaged` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "max_tokens", 1) < 1:
        parser.error(f"--max-tokens {args.max_tokens} must be at least 1")
    if getattr(args, "temperature", 0) < 0:
        parser.error(f"--temperature {args.temperature} must be >= 0")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"jaxpaged: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
