"""Every engine default that more than one place needs, declared once (vLLM's values where vLLM
has the option). No JAX here.

`EngineArgs` declares its options with these; the components with defaults of their own take
theirs from here too: the scheduler's limits (`SchedulerConfig`), `jaxpaged plan` (`make_plan`
and its flags), `jaxpaged generate`'s sizing to the job, the model (`Llama`) and the loader.
tests/test_engine_config.py checks that they agree.
"""

import os

# The model shipped inside the package (jaxpaged/demo_model): what `--model` / `LLM()` give when no
# model is named, and what the name "demo" means.
DEMO_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo_model")
DEMO_MODEL_NAME = "demo"

BLOCK_SIZE = 16  # tokens per KV cache block
GPU_MEMORY_UTILIZATION = 0.9  # fraction of a GPU's memory for weights, activations and the KV cache
MAX_NUM_SEQS = 256  # sequences running at once on a CPU (on a GPU: `batch_limits`)
MAX_LOGPROBS = 20  # the most top logprobs the sampler returns per token (vLLM's --max-logprobs default)
MIN_MAX_NUM_BATCHED_TOKENS = 2048  # tokens per step, unless max_num_seqs asks for more
ENABLE_PREFIX_CACHING = True
NUM_SCHEDULER_STEPS = 4  # decode steps fused into one device program
SCAN_LAYERS = False  # the decoder layers unrolled over per-layer arrays
TENSOR_PARALLEL_SIZE = 1
PIPELINE_PARALLEL_SIZE = 1
DTYPE = "auto"  # the checkpoint's
KV_CACHE_DTYPE = "auto"  # the model's
ATTENTION_BACKEND = "auto"  # the Pallas kernels on a GPU, the jnp reference elsewhere


def max_num_batched_tokens(max_num_seqs: int) -> int:
    """`max_num_batched_tokens` on a CPU when it is not given: 2048, or `max_num_seqs` when that
    is more (every running sequence can decode in one step)."""
    return max(MIN_MAX_NUM_BATCHED_TOKENS, max_num_seqs)


# vLLM's batch limits on GPUs, by who starts the engine (`USAGE_CONTEXTS`: the `LLM` class or the
# OpenAI-compatible server) and whether the GPU is large: (max_num_seqs, max_num_batched_tokens).
# From vLLM's `EngineArgs.get_batch_defaults` (vllm/engine/arg_utils.py): GPUs of at
# least 70 GiB other than the A100 (vLLM PR #17885: large token budgets slow the A100 down) get the
# large limits. Later vLLM releases raise the server's large budget to 16,384.
USAGE_CONTEXTS = ("llm_class", "openai_api_server")
LARGE_GPU_BYTES = 70 * 2**30
GPU_BATCH_LIMITS = {
    ("llm_class", True): (1024, 16384),
    ("openai_api_server", True): (1024, 8192),
    ("llm_class", False): (256, 8192),
    ("openai_api_server", False): (256, 2048),
}


def is_large_gpu(device_kind: str, memory_bytes: int) -> bool:
    """Whether vLLM gives a GPU its large batch limits: at least 70 GiB, and not an A100."""
    return memory_bytes >= LARGE_GPU_BYTES and "a100" not in device_kind.lower()


def batch_limits(
    usage_context: str,
    platform: str,
    device_kind: str,
    memory_bytes: int | None,
    max_model_len: int,
    seqs: int | None = None,
    tokens: int | None = None,
) -> tuple[int, int]:
    """`(max_num_seqs, max_num_batched_tokens)` from the given ones (`seqs`, `tokens`), the unset
    ones (None) filled as vLLM fills them on a GPU: `GPU_BATCH_LIMITS` for a GPU of
    `memory_bytes` (its total memory; None: unknown, the small limits), then, as vLLM's
    `_set_default_max_num_seqs_and_batched_tokens_args`, a default token budget at most
    max_num_seqs x max_model_len and a default max_num_seqs at most the token budget. On a CPU
    (`platform` "cpu") jaxpaged's own: 256 sequences and `max_num_batched_tokens(max_num_seqs)`
    tokens (vLLM's CPU budget of 4,096 tokens per device would compile larger programs than CPU
    runs, which are tests and small jobs, use)."""
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context {usage_context!r} must be one of {USAGE_CONTEXTS}")
    if platform == "cpu":
        seqs = MAX_NUM_SEQS if seqs is None else seqs
        return seqs, max_num_batched_tokens(seqs) if tokens is None else tokens
    large = memory_bytes is not None and is_large_gpu(device_kind, memory_bytes)
    default_seqs, default_tokens = GPU_BATCH_LIMITS[usage_context, large]
    given_seqs = seqs is not None
    seqs = seqs if given_seqs else default_seqs
    tokens = min(seqs * max_model_len, default_tokens) if tokens is None else tokens
    return (seqs if given_seqs else min(seqs, tokens)), tokens


# The most compile threads the default picks (one per two CPU cores): XLA's compiler already uses
# about two cores per program, and each thread holds one program's compiler memory.
MAX_COMPILE_THREADS = 8
