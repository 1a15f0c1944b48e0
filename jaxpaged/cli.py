"""The `jaxpaged` command line.

    jaxpaged generate "In the beginning"                       # the embedded demo model
    jaxpaged generate --model DIR --max-tokens 64 --temperature 0 "prompt" "another prompt"
    jaxpaged generate --input prompts.jsonl --output out.jsonl  # {"prompt": ...} or {"messages": [...]} per line
    jaxpaged serve [MODEL] --port 8000 [--api-key KEY]         # OpenAI-compatible server
    jaxpaged plan --model llama-3.1-8b --gpu-memory 80GiB --context 8192 [--tensor-parallel-size 2] [--json]
"""

import argparse
import json
import logging
import os
import sys

DEMO_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo_model")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags, shared by the subcommands that start an engine."""
    parser.add_argument("--model", default=None, help="HF or converted model directory (default: the embedded demo model)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default: auto)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "reference", "pallas"])
    parser.add_argument("--num-scheduler-steps", type=int, default=4, help="decode steps fused per device program")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """`LLM` / `EngineArgs` keyword arguments from parsed engine flags."""
    return dict(
        model=args.model or DEMO_MODEL_DIR, dtype=args.dtype, max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        tensor_parallel_size=args.tensor_parallel_size, seed=args.seed, load_format=args.load_format,
        attention_backend=args.attention_backend, num_scheduler_steps=args.num_scheduler_steps,
    )  # fmt: skip


def _read_jsonl(path: str) -> list[dict]:
    items = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err.msg})") from None
            if not isinstance(item, dict) or not ({"prompt", "messages", "prompt_token_ids"} & item.keys()):
                raise ValueError(f"{path}:{line_no}: each line needs a 'prompt', 'prompt_token_ids' or 'messages' field")
            items.append(item)
    return items


def _size_engine_to_job(args: argparse.Namespace, prompt_lens: list[int]) -> None:
    """Offline generation knows its whole workload: unless given, size the batch limits to it
    (fewer step shapes to compile than a server's defaults)."""
    if args.max_num_seqs is None:
        args.max_num_seqs = min(256, len(prompt_lens))
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = min(2048, max(sum(prompt_lens), args.max_num_seqs))


def _generate(args: argparse.Namespace) -> int:
    # Imported here so `jaxpaged --help` answers without loading JAX.
    from jaxpaged.llm import LLM
    from jaxpaged.sampling_params import SamplingParams

    if bool(args.prompts) == bool(args.input):
        raise ValueError("give either PROMPT arguments or --input FILE.jsonl")
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.sampling_seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
    )  # fmt: skip
    from transformers import AutoTokenizer

    items = _read_jsonl(args.input) if args.input else [{"prompt": p} for p in args.prompts]
    tokenizer = AutoTokenizer.from_pretrained(args.model or DEMO_MODEL_DIR)
    prompts = []
    for item in items:
        if "messages" in item:
            text = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=False)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        elif "prompt_token_ids" in item:
            prompts.append({"prompt_token_ids": item["prompt_token_ids"]})
        else:
            prompts.append({"prompt": item["prompt"], "prompt_token_ids": tokenizer.encode(item["prompt"])})
    _size_engine_to_job(args, [len(p["prompt_token_ids"]) for p in prompts])
    llm = LLM(**engine_kwargs(args))
    outputs = llm.generate(prompts, params, use_tqdm=bool(args.input))
    if args.output:
        with open(args.output, "w") as f:
            for item, out in zip(items, outputs):
                c = out.outputs[0]
                record = {**item, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        print(f"wrote {len(outputs)} completions to {args.output}", file=sys.stderr)
    else:
        for item, out in zip(items, outputs):
            print((item.get("prompt") or "") + out.outputs[0].text)
            print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxpaged", description="PagedAttention LLM inference in JAX.")
    parser.add_argument("--log-level", default=None, help="logging level (default: INFO for serve, else WARNING)")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="offline batch generation")
    gen.add_argument("prompts", nargs="*", metavar="PROMPT")
    gen.add_argument("--input", help="JSONL file: one {'prompt': ...} or {'messages': [...]} per line")
    gen.add_argument("--output", help="write JSONL results here instead of printing")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 for greedy (default: 0.8)")
    gen.add_argument("--top-p", type=float, default=0.95)
    gen.add_argument("--top-k", type=int, default=40, help="0 for all (default: 40)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible sampling)")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    add_engine_flags(gen)
    gen.set_defaults(run=_generate, max_num_seqs=None, max_num_batched_tokens=None)  # sized to the job

    from jaxpaged.server.cli import add_serve_flags  # no server dependencies needed for the flags

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_flags(serve)
    add_engine_flags(serve)
    serve.set_defaults(run=_serve)

    plan = commands.add_parser("plan", help="weights, KV cache and concurrency of a model on a GPU (no GPU needed)")
    plan.add_argument("--model", required=True, help="a preset (llama-3.1-8b, llama-3.1-70b, mistral-7b-v0.3, "
                      "qwen2.5-7b) or a directory with config.json")  # fmt: skip
    plan.add_argument("--gpu-memory", default="80GiB", help="memory of one GPU, e.g. 80GiB, 141GB (default: 80GiB)")
    plan.add_argument("--context", type=int, default=None, help="tokens per request (default: the model's limit)")
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    plan.add_argument("--tensor-parallel-size", type=int, default=1)
    plan.add_argument("--dtype", default="auto", help="weight dtype: auto (the config's), bfloat16, float16, float32")
    plan.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    plan.add_argument("--block-size", type=int, default=16)
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(run=_plan)
    return parser


def _serve(args: argparse.Namespace) -> int:
    from jaxpaged.server.cli import serve

    return serve(args)


def _plan(args: argparse.Namespace) -> int:
    from jaxpaged.plan import run

    return run(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxpaged` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = args.log_level or ("INFO" if args.command == "serve" else "WARNING")
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    # transformers is only the tokenizer here: its advice that PyTorch is missing is noise.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as err:
        print(f"jaxpaged: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
