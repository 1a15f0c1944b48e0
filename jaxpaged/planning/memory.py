"""KV-cache memory planning: how many blocks fit, and how many requests they serve (no JAX here).

pool bytes = device memory x gpu_memory_utilization - weights - peak activations
             (or exactly kv_cache_memory_bytes when given)
bytes per token = 2 x layers x kv_heads x head_dim x dtype bytes
"""

import dataclasses

from jaxpaged.config import defaults
from jaxpaged.config.checks import check_memory_fraction
from jaxpaged.config.model_config import ModelConfig, kv_bytes_per_token

GiB = 2**30


def format_bytes(n: int) -> str:
    """`n` in the largest binary unit it reaches: "512.00 MiB", "1.50 GiB", "800 B"."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class KVCachePlan:
    """The sized pool.

    Attributes:
      num_blocks: blocks allocated, including the reserved null block 0.
      block_size: tokens per block.
      bytes_per_token: KV bytes of one token over all layers.
      pool_bytes: bytes of the whole pool.
      max_model_len: the context the concurrency figure is computed for.
      sized_from: how the budget was chosen (logged at start-up).
      activation_bytes: the step temporaries the budget reserved (0 when not measured).
    """

    num_blocks: int
    block_size: int
    bytes_per_token: int
    pool_bytes: int
    max_model_len: int
    sized_from: str = ""
    activation_bytes: int = 0

    @property
    def num_tokens(self) -> int:
        """Token slots usable by requests (the null block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many requests of `max_model_len` tokens the pool holds at once."""
        blocks_per_request = -(-self.max_model_len // self.block_size)
        return (self.num_blocks - 1) / blocks_per_request

    def summary(self) -> str:
        return (
            f"KV cache: {self.num_blocks - 1} blocks x {self.block_size} tokens = {self.num_tokens} tokens "
            f"({format_bytes(self.pool_bytes)}; sized from {self.sized_from}); max concurrency at "
            f"max_model_len={self.max_model_len}: {self.max_concurrency:.2f}"
        )


def sequence_state_bytes(max_num_seqs: int, vocab_size: int) -> int:
    """Device bytes of the per-sequence state beside the pool, one row per slot: the penalty
    tables (a bool prompt mask and int32 output counts over the vocabulary) and the newest
    sampled token (int32). Llama-3.1-8B at 256 sequences: 157 MiB."""
    return max_num_seqs * (vocab_size * (1 + 4) + 4)


def plan_kv_cache(
    config: ModelConfig,
    *,
    dtype_bytes: int,
    block_size: int,
    max_model_len: int,
    kv_cache_memory_bytes: int | None = None,
    device_memory_bytes: int | None = None,
    gpu_memory_utilization: float = defaults.GPU_MEMORY_UTILIZATION,
    weight_bytes: int = 0,
    activation_bytes: int = 0,
    sized_from: str | None = None,
    extra_bytes_per_token: int = 0,
    state_bytes: int = 0,
) -> KVCachePlan:
    """Sizes the KV pool.

    Args:
      config: the model.
      dtype_bytes: bytes per cached element (2 for bfloat16).
      block_size: tokens per block.
      max_model_len: the longest request; at least one must fit.
      kv_cache_memory_bytes: an exact pool budget (overrides the device-memory arithmetic).
      device_memory_bytes: memory of one device (needed without kv_cache_memory_bytes).
      gpu_memory_utilization: fraction of device memory the engine may use.
      weight_bytes, activation_bytes: what weights and the largest step's temporaries take.
      sized_from: why the budget is what it is (default: the arithmetic above).
      extra_bytes_per_token: bytes each token also takes elsewhere, block for block (a draft
        model's pool).
      state_bytes: the device state beside the pool (the per-sequence rows, `sequence_state_bytes`,
        and a LoRA adapter pool), out of the device's memory like the weights.

    Raises:
      ValueError: when not even one `max_model_len` request fits, with the numbers and knobs.
    """
    check_memory_fraction(gpu_memory_utilization)
    per_token = kv_bytes_per_token(config, dtype_bytes) + extra_bytes_per_token
    per_block = per_token * block_size
    if kv_cache_memory_bytes is not None:
        budget = kv_cache_memory_bytes
        source = f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
    else:
        if device_memory_bytes is None:
            raise ValueError("device_memory_bytes is required when kv_cache_memory_bytes is not given")
        budget = int(device_memory_bytes * gpu_memory_utilization) - weight_bytes - activation_bytes - state_bytes
        source = (
            f"{device_memory_bytes / GiB:.2f} GiB x gpu_memory_utilization={gpu_memory_utilization} - "
            f"weights {weight_bytes / GiB:.2f} GiB - activations {activation_bytes / GiB:.2f} GiB - "
            f"per-sequence state and adapters {state_bytes / GiB:.2f} GiB"
        )
    num_blocks = max(budget, 0) // per_block  # the null block comes out of the budget too
    needed = -(-max_model_len // block_size) + 1
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache budget ({source} = {max(budget, 0) / GiB:.3f} GiB) holds {max(num_blocks - 1, 0)} blocks "
            f"of {block_size} tokens, but one request of max_model_len={max_model_len} needs {needed - 1}; "
            "raise gpu_memory_utilization or kv_cache_memory_bytes, or lower max_model_len"
        )
    return KVCachePlan(
        num_blocks=int(num_blocks),
        block_size=block_size,
        bytes_per_token=per_token,
        pool_bytes=int(num_blocks * per_block),
        max_model_len=max_model_len,
        sized_from=sized_from or source,
        activation_bytes=activation_bytes,
    )
