"""The KV pool a replayed engine gets: the memory plan's arithmetic with an estimate of the
largest step's activations, which the engine measures at start-up and the plan cannot (no JAX).

    activations = T_max x ACTIVATION_BYTES_PER_TOKEN_WIDTH x (hidden + intermediate)   (the mixed step's temporaries)
                  + S_max x SAMPLER_BYTES_PER_ROW_VOCAB x vocabulary                 (its logits, the sampler's temporaries)

Both coefficients come from Llama-3.1-8B at 2,048 tokens / 256 sequences: the mixed step's
temporaries compiled for an H100 (633,465,600 B, benchmarks/results/quant_hlo_h100_deviceless_bf16_large_steps.json,
"mixed:2048" temp_bytes), and the rest of what the first H100 run reserved (its pool of 27,928 usable
blocks, engine_start.json, leaves 1,697 MB for activations) per sampler row.
"""

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.quantization import DTYPE_BYTES
from jaxpaged.planning.memory import KVCachePlan, plan_kv_cache, sequence_state_bytes
from jaxpaged.planning.plan import weight_bytes_per_gpu

ACTIVATION_BYTES_PER_TOKEN_WIDTH = 633_465_600 / 2048 / (4096 + 14336)  # ~16.8
SAMPLER_BYTES_PER_ROW_VOCAB = (1_697_000_000 - 633_465_600) / 256 / 128256  # ~32.4: ~8 float32 rows of logits


def activation_bytes(config: ModelConfig, max_tokens: int, max_seqs: int) -> int:
    """The estimated temporaries of the largest step (T_max = `max_tokens`, S_max = `max_seqs`)."""
    width = config.hidden_size + config.intermediate_size
    per_token = ACTIVATION_BYTES_PER_TOKEN_WIDTH * width
    return int(max_tokens * per_token + max_seqs * SAMPLER_BYTES_PER_ROW_VOCAB * config.vocab_size)


def replay_pool(
    config: ModelConfig,
    *,
    dtype: str,
    memory_bytes: int,
    gpu_memory_utilization: float,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_tokens: int,
) -> KVCachePlan:
    """The pool of an engine of these limits on a GPU of `memory_bytes` (one GPU, no quantization):
    the engine's `plan_kv_cache` with its weights, per-sequence state and estimated activations
    (`max_tokens`: the largest token bucket).

    Raises:
      ValueError: not even one request of max_model_len fits (the plan's message).
    """
    return plan_kv_cache(
        config,
        dtype_bytes=DTYPE_BYTES[dtype],
        block_size=block_size,
        max_model_len=max_model_len,
        device_memory_bytes=memory_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        weight_bytes=weight_bytes_per_gpu(config, dtype, None, 1),
        activation_bytes=activation_bytes(config, max_tokens, max_num_seqs),
        state_bytes=sequence_state_bytes(max_num_seqs, config.vocab_size),
    )
