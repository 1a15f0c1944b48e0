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
MAX_NUM_SEQS = 256  # sequences running at once
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
    """`max_num_batched_tokens` when it is not given: 2048, or `max_num_seqs` when that is more
    (every running sequence can decode in one step)."""
    return max(MIN_MAX_NUM_BATCHED_TOKENS, max_num_seqs)


# The most compile threads the default picks (one per two CPU cores): XLA's compiler already uses
# about two cores per program, and each thread holds one program's compiler memory.
MAX_COMPILE_THREADS = 8
