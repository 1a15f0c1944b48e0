"""The `jaxpaged` command line.

    jaxpaged generate "In the beginning"                       # the embedded demo model
    jaxpaged generate --model DIR --max-tokens 64 --temperature 0 "prompt" "another prompt"
    jaxpaged generate --input prompts.jsonl --output out.jsonl  # {"prompt": ...} or {"messages": [...]} per line
    jaxpaged serve [MODEL] --port 8000 [--api-key KEY]         # OpenAI-compatible server
    jaxpaged plan --model llama-3.1-8b --gpu-memory 80GiB --context 8192 [--tensor-parallel-size 2]
                  [--pipeline-parallel-size 2] [--json]
    jaxpaged plan --model llama-3.1-8b --gpu h200 --workload sharegpt [--request-rate 16]  # + tokens/s, TTFT, TPOT
    jaxpaged bench throughput|latency|serve|plot|startup ...  # benchmarks (vLLM's `vllm bench`)

Parsing and checking every flag imports no JAX: a mistake is reported at once, and each command
says what it is doing within a second of starting.
"""

import argparse
import difflib
import importlib.metadata
import logging
import os
import sys

from jaxpaged.bench.cli import add_bench_parser
from jaxpaged.bench.throughput_model import add_plan_throughput_flags
from jaxpaged.config import defaults
from jaxpaged.config.presets import PRESETS
from jaxpaged.config.quantization import DEFAULT_GROUP_SIZE, QUANTIZATION_METHODS
from jaxpaged.entrypoints import cli_generate
from jaxpaged.entrypoints.cli_flags import BYTES_WITH_UNIT, HelpFormatter, add_engine_flags, describe_error
from jaxpaged.planning.plan import PLAN_KV_CACHE_DTYPES
from jaxpaged.server.cli import add_serve_flags

__all__ = ["build_parser", "main"]

DEFAULT_LOG_LEVEL = "INFO"


def build_parser() -> argparse.ArgumentParser:
    """The `jaxpaged` parser with its `generate`, `serve`, `plan` and `bench` subcommands."""
    parser = argparse.ArgumentParser(
        prog="jaxpaged",
        description="PagedAttention LLM inference in JAX.",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"jaxpaged {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser(
        "generate",
        help="offline batch generation",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
        description=cli_generate.__doc__.split("\n\n")[0],
    )
    cli_generate.add_generate_flags(gen)
    # Sequences and batched tokens default to the job's size (fewer step programs to compile).
    add_engine_flags(gen, job_sized=("max_num_seqs", "max_num_batched_tokens", "max_model_len"))
    gen.set_defaults(run=cli_generate.run)

    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server", formatter_class=HelpFormatter, allow_abbrev=False
    )  # a misspelt flag is an error, never another flag
    add_serve_flags(serve)
    add_engine_flags(serve)
    serve.set_defaults(run=_serve)

    plan = commands.add_parser(
        "plan",
        help="weights, KV cache and concurrency of a model on a GPU (no GPU needed)",
        formatter_class=HelpFormatter,
        allow_abbrev=False,
    )
    plan.add_argument(
        "--model",
        required=True,
        help=f"a preset ({', '.join(PRESETS)}) or a directory with config.json",
    )
    plan.add_argument(
        "--gpu-memory",
        default=None,
        type=BYTES_WITH_UNIT,
        help="memory of one GPU with its unit, e.g. 80GiB or 141GB; with --gpu, that GPU's (default: 80GiB)",
    )
    plan.add_argument("--context", type=int, default=None, help="tokens per request (default: the model's limit)")
    plan.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=defaults.GPU_MEMORY_UTILIZATION,
        help="fraction of GPU memory to use",
    )
    plan.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=defaults.TENSOR_PARALLEL_SIZE,
        help="GPUs the model is split over (in each pipeline stage)",
    )
    plan.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=defaults.PIPELINE_PARALLEL_SIZE,
        help="stages of contiguous decoder layers, each on its own --tensor-parallel-size GPUs",
    )
    plan.add_argument(
        "--pp-layer-partition",
        default=None,
        metavar="N,N,...",
        help="decoder layers per pipeline stage, e.g. 63,63 (default: balanced)",
    )
    plan.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="a mixture of experts' experts split over the tensor-parallel GPUs whole",
    )
    plan.add_argument(
        "--dtype", default=defaults.DTYPE, help="weight dtype: auto (the config's), bfloat16, float16, float32"
    )
    plan.add_argument(
        "--kv-cache-dtype",
        default=defaults.KV_CACHE_DTYPE,
        choices=PLAN_KV_CACHE_DTYPES,
        help="KV cache dtype (auto: the weights'; fp8 = fp8_e4m3 and fp8_e5m2: 1 byte per element)",
    )
    plan.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATION_METHODS,
        help="weight quantization (fp8/int8: 1 byte per quantized weight, plus a float32 scale per output channel; "
        "int4: half a byte, plus a float32 scale and an int8 zero point per group; awq, gptq, compressed-tensors: "
        "a checkpoint in that format, its bits and groups from its config.json)",
    )
    plan.add_argument(
        "--quantization-group-size",
        type=int,
        default=DEFAULT_GROUP_SIZE,
        help="input features per group of --quantization int4",
    )
    plan.add_argument("--block-size", type=int, default=defaults.BLOCK_SIZE, help="tokens per KV cache block")
    plan.add_argument("--enable-lora", action="store_true", help="leave room for a LoRA adapter pool (serve's flag)")
    plan.add_argument("--max-loras", type=int, default=1, help="the adapter pool's slots, with --enable-lora")
    plan.add_argument("--max-lora-rank", type=int, default=16, help="the adapter pool's rank, with --enable-lora")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_plan_throughput_flags(plan)
    plan.set_defaults(run=_plan)

    add_bench_parser(commands)
    for command in (parser, *_subparsers(parser)):  # before or after the subcommand
        command.add_argument(
            "--log-level",
            default=DEFAULT_LOG_LEVEL if command is parser else argparse.SUPPRESS,
            metavar="LEVEL",
            help=f"level of jaxpaged's own log lines on stderr (default: {DEFAULT_LOG_LEVEL})",
        )
    return parser


def _version() -> str:
    try:
        return importlib.metadata.version("jaxpaged")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every subcommand's parser below `parser` (`bench serve`'s included)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += [sub, *_subparsers(sub)]
    return found


def _serve(args: argparse.Namespace) -> int:
    from jaxpaged.server.cli import serve

    return serve(args)


def _plan(args: argparse.Namespace) -> int:
    from jaxpaged.bench import throughput_model
    from jaxpaged.planning.plan import run

    throughput_model.check_flags(args)
    throughput_model.resolve_gpu(args)
    if args.workload is not None or args.calibration:
        return throughput_model.run(args)
    return run(args)


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[command]


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The parser of the command that ran (`bench serve`'s for `jaxpaged bench serve`)."""
    command = _subparser(parser, args.command)
    return _subparser(command, args.bench_command) if args.command == "bench" else command


def _did_you_mean(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """ " (did you mean --max-num-seqs?)" for the flags of `parser` closest to the unknown ones
    (argparse's own `suggest_on_error` is Python 3.14's, and covers choices only)."""
    flags = [flag for flag in parser._option_string_actions if flag.startswith("--")]
    guesses = []
    for word in unknown:
        if word.startswith("-"):
            guesses += difflib.get_close_matches(word.split("=")[0], flags, n=1, cutoff=0.75)
    return f" (did you mean {', '.join(guesses)}?)" if guesses else ""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxpaged` console script; returns the exit code (2 for bad input)."""
    parser = build_parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        command = _command_parser(parser, args)
        if unknown:
            command.error(f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(unknown, command)}")
        level = args.log_level.upper()
        if not isinstance(logging.getLevelName(level), int):
            command.error(f"--log-level {args.log_level}: use DEBUG, INFO, WARNING or ERROR")
    except SystemExit as done:  # --help, --version, or a flag rejected (already printed)
        return int(done.code or 0)
    # Other libraries stay at WARNING; jaxpaged's start-up progress shows at INFO.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jaxpaged").setLevel(level)
    # transformers is only the tokenizer here: its advice that PyTorch is missing is noise.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as err:
        print(f"jaxpaged: error: {describe_error(err, command)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before a command handles it (while JAX loads, say)
        print(f"jaxpaged {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
