"""What each stage runs, on a GPU and under `--smoke`: the model, the engine's limits, the
workloads and the time budgets. Every number the GPU run depends on is a constant here."""

import dataclasses
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_MODEL_DIR = os.path.join(ROOT, "jaxpaged", "demo_model")
DEFAULT_DATASET = os.path.join(ROOT, "benchmarks", "data", "sharegpt_1000.json")

# Seconds per stage, most valuable first; with the device probe they sum to 9.5 minutes, inside
# one 10-minute device call. A stage that ends early hands its unused seconds to the next.
STAGE_BUDGETS_S = {"kernels": 120, "startup": 60, "engine_start": 70, "latency": 90, "throughput": 125, "serve": 85}
PROBE_TIMEOUT_S = 20
SMOKE_STAGE_BUDGET_S = 240

# One set of engine limits for every 8B engine (latency, throughput, serving and the start-up
# measurements), so that their step programs are the same and the later stages load them from the
# compilation cache that engine_start filled. 2048 tokens hold any ShareGPT pair vLLM's filter keeps.
GPU_ENGINE_LIMITS = ("--max-model-len", "2048", "--max-num-seqs", "256", "--max-num-batched-tokens", "2048")
# The smoke run's engines compile three programs (one token bucket) instead of a dozen.
SMOKE_ENGINE_LIMITS = (
    "--max-model-len",
    "128",
    "--max-num-seqs",
    "1",
    "--max-num-batched-tokens",
    "16",
    "--num-scheduler-steps",
    "1",
)
# The smoke run's numbers mean nothing: XLA's CPU compiler may skip its slow optimisations (~40%
# of each compile on the 2-core CI machine).
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

# The offline run must keep this many seconds for jaxpaged itself after transformers' share.
THROUGHPUT_JAXPAGED_RESERVE_S = 60


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything the stages need to build their commands."""

    smoke: bool
    model: str
    weight_flags: tuple[str, ...]  # dtype and load format
    engine_limits: tuple[str, ...]
    kernel_flags: tuple[str, ...]
    kv_transfer_flags: tuple[str, ...]  # benchmarks/kv_transfer_bandwidth.py (the host tier's copies)
    latency_flags: tuple[str, ...]
    throughput_flags: tuple[str, ...]  # dataset flags without --dataset-path
    compare_transformers: bool
    serve_rates: tuple[str, ...]
    serve_flags: tuple[str, ...]  # dataset flags of every `bench serve`
    budgets_s: dict


def gpu_plan(budgets: dict) -> Plan:
    """Llama-3.1-8B's shapes with random bf16 weights, on the GPU."""
    return Plan(
        smoke=False,
        model="llama-3.1-8b",
        weight_flags=("--dtype", "bfloat16", "--load-format", "dummy"),
        engine_limits=GPU_ENGINE_LIMITS,
        kernel_flags=(),
        kv_transfer_flags=("--model", "llama-3.1-8b", "--blocks", "256"),
        latency_flags=(
            "--batch-size",
            "1",
            "--input-len",
            "32",
            "--output-len",
            "128",
            "--num-iters-warmup",
            "3",
            "--num-iters",
            "10",
        ),
        throughput_flags=("--dataset-name", "sharegpt", "--num-prompts", "1000"),
        compare_transformers=True,
        # The 8B preset has no tokenizer, so the server takes token ids: random prompts of
        # ShareGPT's typical lengths (~200 in, ~180 out).
        serve_rates=("4", "16", "inf"),
        serve_flags=("--dataset-name", "random", "--num-prompts", "200", "--input-len", "200", "--output-len", "180"),
        budgets_s={**STAGE_BUDGETS_S, **budgets},
    )


def smoke_plan(budgets: dict) -> Plan:
    """The demo model, tiny limits and workloads, kernels in interpret mode: the whole run on a CPU."""
    return Plan(
        smoke=True,
        model=DEMO_MODEL_DIR,
        weight_flags=("--skip-tokenizer-init",),
        engine_limits=SMOKE_ENGINE_LIMITS,
        kernel_flags=("--smoke",),
        kv_transfer_flags=("--model", DEMO_MODEL_DIR, "--blocks", "8", "--repeats", "1"),
        latency_flags=("--input-len", "8", "--output-len", "8", "--num-iters-warmup", "1", "--num-iters", "2"),
        # transformers' continuous batching takes ~45 s to start on the CI machine's CPU; the
        # comparison itself is tested in tests/test_bench_offline.py.
        throughput_flags=("--dataset-name", "sharegpt", "--num-prompts", "4", "--output-len", "8"),
        compare_transformers=False,
        serve_rates=("4", "16", "inf"),
        serve_flags=("--dataset-name", "random", "--num-prompts", "4", "--input-len", "16", "--output-len", "8"),
        budgets_s={**{name: SMOKE_STAGE_BUDGET_S for name in STAGE_BUDGETS_S}, **budgets},
    )
