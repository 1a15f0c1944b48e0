"""The throughput and latency model of `jaxpaged plan --workload`: a model, a GPU, limits and a
workload in; tokens/s, TTFT/TPOT/ITL and concurrency out (no JAX here).

1. Limits: the given `max_num_seqs` / `max_num_batched_tokens`, the rest vLLM's defaults for the
   GPU and the entry point (`jaxpaged.config.defaults.batch_limits`: the `LLM` class or the server).
2. Buckets: the engine's rule for those limits (handed in: `buckets.BucketFactory`), with the
   finer-buckets lever on top if asked.
3. Pool: the engine's memory plan on the GPU's memory (`pool.replay_pool`), so preemption comes
   when it would on the GPU.
4. Replay (`replay.py`) of the workload, arriving at `request_rate` (inf: all at once), each
   step priced by `step_cost.StepCoster`; the figures (`report.summarize`).

Its error against every GPU run committed is `calibration.py`'s table; `STATED_ERROR` says it in
a line, and tests/test_plan_throughput.py holds the model to it.
"""

import dataclasses
import math

from jaxpaged.config import defaults
from jaxpaged.core.scheduler import SchedulerConfig
from jaxpaged.engine_config import EngineConfig
from jaxpaged.planning.buckets import BucketFactory, Limits, finer_buckets, powers_of_two
from jaxpaged.planning.gpus import get_gpu
from jaxpaged.planning.model_costs import model_costs
from jaxpaged.planning.pool import replay_pool
from jaxpaged.planning.replay import EngineSetup, replay
from jaxpaged.planning.report import summarize
from jaxpaged.planning.step_cost import Levers, StepCoster, StepCosts
from jaxpaged.planning.workloads import Workload, arrival_times

# How far the model may be off against the committed GPU runs, by kind of figure (relative error);
# calibration.py holds every measurement to its bound, tests/test_plan_throughput.py checks it.
THROUGHPUT_BOUND = 0.08  # offline durations, serving durations
MEDIAN_LATENCY_BOUND = 0.12  # median TPOT and ITL
TTFT_BOUND = 0.35  # median TTFT
STATED_ERROR = (
    f"against the first H100 run (calibration.py): offline throughput and serving durations within "
    f"{THROUGHPUT_BOUND:.0%}, median TPOT and ITL within {MEDIAN_LATENCY_BOUND:.0%}, median TTFT within "
    f"{TTFT_BOUND:.0%}; tails (p99) are not modelled"
)


@dataclasses.dataclass(frozen=True)
class ThroughputQuery:
    """What to predict.

    Attributes:
      workload: the requests (`workloads.py`).
      model: a preset or a directory with config.json.
      gpu: a key of `gpus.GPUS`.
      request_rate: requests per second (Poisson arrivals, `bench serve`'s schedule); inf: all at once.
      seed: the arrivals' seed.
      usage_context: "llm_class" or "openai_api_server" (vLLM's default limits differ).
      max_num_seqs, max_num_batched_tokens: the limits; None: vLLM's default.
      max_model_len: the context; None: the model's.
      gpu_memory_utilization, block_size, num_scheduler_steps, enable_prefix_caching: the engine's options.
      async_scheduling: schedule step N+1 while N runs (the engine's default).
      stream: requests stream (no fused decode steps while one does).
      dtype: weights and KV cache ("bfloat16" or "float16").
      memory_bytes: the GPU's memory to plan the pool from; None: the GPU's.
      levers: changes to price.
      costs: the calibrated efficiencies.
    """

    workload: Workload
    model: str = "llama-3.1-8b"
    gpu: str = "h100"
    request_rate: float = math.inf
    seed: int = 0
    usage_context: str = "llm_class"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = defaults.GPU_MEMORY_UTILIZATION
    block_size: int = defaults.BLOCK_SIZE
    num_scheduler_steps: int = defaults.NUM_SCHEDULER_STEPS
    enable_prefix_caching: bool = defaults.ENABLE_PREFIX_CACHING
    async_scheduling: bool = True
    stream: bool = False
    dtype: str = "bfloat16"
    memory_bytes: int | None = None
    levers: Levers = Levers()
    costs: StepCosts = StepCosts()


def predict(query: ThroughputQuery, buckets: BucketFactory) -> dict:
    """The prediction as a JSON-ready dict: what was assumed (limits, pool, levers) and the figures.

    Args:
      query: what to predict.
      buckets: the engine's bucket rule for given limits.

    Raises:
      ValueError: a bad value, naming its flag; a request longer than the context.
    """
    if not query.request_rate > 0:
        raise ValueError(f"--request-rate {query.request_rate}: must be positive (inf: all at once)")
    gpu = get_gpu(query.gpu)
    memory = query.memory_bytes or gpu.memory_bytes
    engine = EngineConfig.for_shapes(  # the engine's own resolution and vLLM's limits for the GPU
        query.model,
        context_flag="context",
        max_model_len=query.max_model_len,
        block_size=query.block_size,
        max_num_seqs=query.max_num_seqs,
        max_num_batched_tokens=query.max_num_batched_tokens,
        usage_context=query.usage_context,
    ).with_batch_limits("cuda", gpu.description, memory)
    config, max_model_len = engine.model, engine.max_model_len
    seqs, tokens = engine.scheduling.max_num_seqs, engine.scheduling.max_num_batched_tokens
    longest = max(r.prompt_len + r.output_len for r in query.workload.requests)
    if longest > max_model_len:
        raise ValueError(f"--context {max_model_len}: the workload has a request of {longest} tokens; raise --context")
    limits = Limits(seqs, tokens, max_model_len, query.block_size, config.vocab_size)
    rule = buckets(limits)
    if not query.levers.three_quarter_buckets:
        rule = powers_of_two(rule, seqs)
    if query.levers.token_bucket_step is not None:
        rule = finer_buckets(rule, query.levers.token_bucket_step, seqs)
    pool = replay_pool(
        config,
        dtype=query.dtype,
        memory_bytes=memory,
        gpu_memory_utilization=query.gpu_memory_utilization,
        block_size=query.block_size,
        max_model_len=max_model_len,
        max_num_seqs=seqs,
        max_tokens=rule(tokens, 1)[0],
    )
    scheduler = SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        max_model_len=max_model_len,
        block_size=query.block_size,
        num_blocks=pool.num_blocks,
        enable_prefix_caching=query.enable_prefix_caching,
        num_scheduler_steps=query.num_scheduler_steps,
    )
    coster = StepCoster(model_costs(query.model, query.dtype), gpu, query.costs, query.levers)
    arrivals = arrival_times(len(query.workload.requests), query.request_rate, query.seed)
    setup = EngineSetup(scheduler, query.async_scheduling, query.stream)
    result = replay(query.workload, arrivals, setup, rule, coster)
    w = query.workload
    return {
        "gpu": gpu.name,
        "gpu_description": gpu.description,
        "model": query.model,
        "workload": w.name,
        "num_requests": len(w.requests),
        "prompt_tokens": w.prompt_tokens,
        "output_tokens": w.output_tokens,
        "request_rate": query.request_rate if math.isfinite(query.request_rate) else "inf",
        "max_concurrency_cap": w.max_concurrency,
        "usage_context": query.usage_context,
        "max_num_seqs": seqs,
        "max_num_batched_tokens": tokens,
        "limits_given": {"max_num_seqs": query.max_num_seqs, "max_num_batched_tokens": query.max_num_batched_tokens},
        "max_model_len": max_model_len,
        "num_scheduler_steps": query.num_scheduler_steps,
        "async_scheduling": query.async_scheduling,
        "stream": query.stream,
        "kv_cache_blocks": pool.num_blocks - 1,
        "pool_tokens": pool.num_tokens,
        "activation_bytes_estimate": pool.activation_bytes,
        "levers": query.levers.names(),
        "predicted": summarize(result),
        "stated_error": STATED_ERROR,
    }


def format_prediction(r: dict) -> str:
    """The prediction as an aligned table (after the memory plan's)."""
    p = r["predicted"]

    def lat(name: str) -> str:
        s = p[name]
        return f"median {s['median']:.1f} ms, p99 {s['p99']:.1f} ms"

    rate = r["request_rate"]
    cap = f", at most {r['max_concurrency_cap']} in flight" if r["max_concurrency_cap"] else ""
    programs = p["programs"]
    split = ", ".join(f"{k} {v:.0%}" for k, v in p["time_split"].items())
    rows = [
        ("throughput model", f"{r['model']} on {r['gpu']} ({r['gpu_description']})"),
        (
            "workload",
            f"{r['workload']}: {r['num_requests']:,} requests, {r['prompt_tokens']:,} prompt / "
            f"{r['output_tokens']:,} output tokens, rate {rate}{cap}",
        ),
        (
            "limits",
            f"max_num_seqs {r['max_num_seqs']:,}, max_num_batched_tokens {r['max_num_batched_tokens']:,} "
            f"({r['usage_context']}), {r['num_scheduler_steps']} fused decode steps"
            + ("" if r["async_scheduling"] else ", no async scheduling")
            + (", streamed" if r["stream"] else ""),
        ),
        (
            "KV pool",
            f"{r['pool_tokens']:,} tokens (activations estimated {r['activation_bytes_estimate'] / 2**30:.2f} GiB)",
        ),
        ("levers", ", ".join(r["levers"]) or "none (the engine as it is)"),
        ("duration", f"{p['duration_s']:.2f} s"),
        (
            "throughput",
            f"{p['output_throughput']:,.0f} output tok/s, {p['total_token_throughput']:,.0f} total tok/s, "
            f"{p['request_throughput']:.2f} req/s",
        ),
        ("TTFT", lat("ttft_ms")),
        ("TPOT", lat("tpot_ms")),
        ("ITL", lat("itl_ms")),
        ("E2E latency", lat("e2el_ms")),
        (
            "concurrency",
            f"max {p['max_concurrency']:,} running, mean {p['mean_concurrency']:.0f}; "
            f"{p['num_preemptions']} preemptions",
        ),
        (
            "programs",
            f"{programs['mixed']:,} mixed, {programs['decode']:,} decode, {programs['fused']:,} fused "
            f"({p['device_steps']:,} device steps); padding {p['padding_fraction']:.0%} "
            f"(mixed steps {p['mixed_padding_fraction']:.0%})",
        ),
        ("device time", split),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append(f"model error: {r['stated_error']}")
    return "\n".join(lines)
