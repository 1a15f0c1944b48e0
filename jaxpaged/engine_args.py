"""Engine configuration with vLLM's argument names, and the planning that turns it into sizes."""

import dataclasses
import os


@dataclasses.dataclass
class EngineArgs:
    """Everything `LLM(...)` and `jaxpaged serve` accept (vLLM's names and defaults).

    Attributes:
      model: a Hugging Face or converted model directory (a directory with only config.json
        works with `load_format="dummy"`).
      tokenizer: tokenizer directory (default: the model directory).
      dtype: "auto" (the checkpoint's), "float32", "bfloat16" or "float16".
      max_model_len: longest sequence, prompt + output (default: the model's limit).
      gpu_memory_utilization: fraction of device memory for weights, activations and KV cache.
      kv_cache_memory_bytes: an exact KV-cache budget; overrides gpu_memory_utilization.
      block_size: tokens per KV-cache block.
      max_num_seqs: most sequences running at once.
      max_num_batched_tokens: most tokens per step (default: max(2048, max_num_seqs)).
      enable_prefix_caching: reuse the KV of equal prompt prefixes.
      seed: engine seed; requests without their own seed draw one from it.
      load_format: "auto" (read weights) or "dummy" (random weights, real shapes).
      tensor_parallel_size: devices to shard over (only 1 is supported so far).
      compilation_cache_dir: a persistent JAX compilation cache directory, or None.
      attention_backend: "auto" (Pallas kernels on GPU, jnp reference elsewhere), "reference"
        or "pallas" (interpret mode on CPU).
      skip_tokenizer_init: run without a tokenizer: prompts must be token ids, outputs carry
        token ids and empty text, no stop strings (for benchmarks on config-only directories).
      num_scheduler_steps: decode steps fused into one device program when every running
        sequence is decoding and nothing waits (the host then syncs once per that many
        tokens); 1 runs one step per program.
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    load_format: str = "auto"
    tensor_parallel_size: int = 1
    compilation_cache_dir: str | None = None
    attention_backend: str = "auto"
    num_scheduler_steps: int = 4
    skip_tokenizer_init: bool = False

    def __post_init__(self):
        if not os.path.isdir(self.model):
            raise ValueError(
                f"model={self.model!r} is not a directory; pass a Hugging Face or jaxpaged-convert "
                "model directory (nothing is downloaded)"
            )
        if self.attention_backend not in ("auto", "reference", "pallas"):
            raise ValueError(f"attention_backend={self.attention_backend!r} must be 'auto', 'reference' or 'pallas'")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format={self.load_format!r} is not supported; use 'auto' or 'dummy'")
        if self.tensor_parallel_size != 1:
            raise NotImplementedError(
                f"tensor_parallel_size={self.tensor_parallel_size}: tensor parallelism is not implemented yet; use 1"
            )
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a power of two")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.num_scheduler_steps < 1:
            raise ValueError(f"num_scheduler_steps={self.num_scheduler_steps} must be at least 1")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be at least 1")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = max(2048, self.max_num_seqs)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least max_num_seqs={self.max_num_seqs}"
            )
