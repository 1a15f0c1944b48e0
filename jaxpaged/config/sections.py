"""The typed parts of the engine's resolved configuration (vLLM's names: load, cache, scheduling,
parallel, compile, lora), what each component receives instead of the options object. No JAX here.

Each part's fields are `EngineArgs` fields of the same name, resolved (`EngineConfig.resolve`
fills them from the options), plus what start-up decides (the checkpoint's dtype, the pool's
size). Defaults and help texts are declared on `EngineArgs` only; a part declares which options
it holds, and tests/test_engine_config.py checks that every option lands in exactly one part.
"""

import dataclasses

from jaxpaged.config import defaults
from jaxpaged.config.checks import check_batch_limits
from jaxpaged.config.kv_events import KVEventsConfig
from jaxpaged.config.quantization import StoredWeights, kv_dtype_name


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    """What the weights are and how the model is built from them.

    Attributes:
      model: the model directory (or, with dummy weights, a preset).
      tokenizer: the tokenizer's directory (`tokenizer`, else `model`); None with
        `skip_tokenizer_init`.
      skip_tokenizer_init: token ids in and out, no tokenizer.
      load_format: "auto" reads the weights, "dummy" makes random ones.
      dtype: the option ("auto" is `checkpoint.dtype`).
      checkpoint: how the checkpoint stores its weights (its dtype, a pre-quantized method and
        format), as config.json says.
      quantization: the weights' method (the option, or the checkpoint's), or None.
      quantization_group_size: input features per group of "int4" (the model config holds the
        resolved groups: `ModelConfig.weight_group_size`).
      attention_backend: "auto", "pallas" or "reference".
      scan_layers: layers as one loop body over stacked weights.
      seed: the engine seed (resolved: never None).
      generation_config: the option ("auto", "vllm" or a directory).
      sampling_defaults: what the generation config sets, as `SamplingParams` fields (resolved
        from `generation_config`: a tuple of (field, value) pairs).
    """

    model: str
    tokenizer: str | None
    skip_tokenizer_init: bool
    load_format: str
    dtype: str
    checkpoint: StoredWeights
    quantization: str | None
    quantization_group_size: int
    attention_backend: str
    scan_layers: bool
    seed: int
    generation_config: str
    sampling_defaults: tuple


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The KV cache: its blocks on the devices and the host and disk tiers behind them.

    Attributes:
      block_size: tokens per block.
      kv_cache_dtype: the option ("auto": the model's dtype; see `kv_dtype`).
      gpu_memory_utilization: the share of device memory the plan may use.
      kv_cache_memory_bytes: the pool's exact size, or None (sized from the memory).
      enable_prefix_caching: reuse the blocks of equal prefixes.
      kv_offloading_size: GiB of the host tier, or None.
      kv_cache_dir: the disk tier's directory, or None.
      kv_cache_dir_size: GiB of files the disk tier keeps.
      preemption_mode: the option (None: see `resolved_preemption_mode`).
      kv_events_config: the KV event options, or None (off).
      num_blocks: blocks per device, the null block included (0 until planned).
      num_host_blocks: blocks of the host tier (0: none; planned with the pool).
    """

    block_size: int
    kv_cache_dtype: str
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    enable_prefix_caching: bool
    kv_offloading_size: float | None
    kv_cache_dir: str | None
    kv_cache_dir_size: float
    preemption_mode: str | None
    kv_events_config: KVEventsConfig | None = None
    num_blocks: int = 0
    num_host_blocks: int = 0

    def kv_dtype(self, model_dtype) -> str:
        """The KV cache's (logical) dtype name: `kv_cache_dtype`, or with "auto" the model's."""
        return kv_dtype_name(self.kv_cache_dtype, str(model_dtype))

    @property
    def resolved_preemption_mode(self) -> str:
        """`preemption_mode`, resolved: swap when there is a host tier, unless told otherwise."""
        return self.preemption_mode or ("swap" if self.num_host_blocks else "recompute")


@dataclasses.dataclass(frozen=True)
class SchedulingConfig:
    """How steps are batched (the scheduler's limits but the ones the pool decides).

    Attributes:
      max_num_seqs: sequences running at once (None until the devices are known: vLLM's default
        for them, `with_batch_limits`).
      max_num_batched_tokens: tokens computed per step (None: as max_num_seqs).
      num_scheduler_steps: decode steps fused into one device program.
      async_scheduling: dispatch each step before the previous one's tokens reach the host.
      max_logprobs: most logprobs per token a request may ask for.
      usage_context: who started the engine ("llm_class" or "openai_api_server"): picks the
        default limits.
    """

    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    num_scheduler_steps: int
    async_scheduling: bool
    max_logprobs: int
    usage_context: str

    def with_batch_limits(
        self, platform: str, device_kind: str, memory_bytes: int | None, max_model_len: int
    ) -> "SchedulingConfig":
        """These limits with the unset ones filled with vLLM's defaults for the device
        (`jaxpaged.config.defaults.batch_limits`).

        Raises:
          OptionError: the token budget, given or default, holds fewer tokens than max_num_seqs.
        """
        seqs, tokens = defaults.batch_limits(
            self.usage_context,
            platform,
            device_kind,
            memory_bytes,
            max_model_len,
            self.max_num_seqs,
            self.max_num_batched_tokens,
        )
        check_batch_limits(seqs, tokens)
        return dataclasses.replace(self, max_num_seqs=seqs, max_num_batched_tokens=tokens)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How many devices and processes the engine spans.

    Attributes:
      tensor_parallel_size: devices the model is split over (in each pipeline stage).
      pipeline_parallel_size: stages the decoder layers are split into.
      pp_layer_partition: layers per stage, first to last (resolved from its text), or None:
        balanced (`EngineConfig.layout.pipeline` holds the split).
      enable_expert_parallel: a mixture of experts' experts split over them whole.
      data_parallel_size: engine replicas the server runs (each with this layout).
      data_parallel_rank: this replica among them (it offsets the seed and the KV-event ports,
        and picks the devices).
      nnodes: processes of the engine.
      node_rank: this process among them (0 schedules).
      master_addr: where the processes meet.
      master_port: the port they meet on.
    """

    tensor_parallel_size: int
    pipeline_parallel_size: int
    pp_layer_partition: tuple[int, ...] | None
    enable_expert_parallel: bool
    data_parallel_size: int
    data_parallel_rank: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """How the step programs are compiled.

    Attributes:
      compile_threads: programs compiled at once.
      compilation_cache_dir: "auto", "none" or a directory (the persistent cache).
    """

    compile_threads: int
    compilation_cache_dir: str


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters served over the base model (`jaxpaged.lora`).

    Attributes:
      enable_lora: requests may name an adapter.
      max_loras: adapters on the device at once (the adapter pool's slots).
      max_lora_rank: the pool's rank: an adapter's rank may be at most this.
      max_cpu_loras: adapters kept read in host memory (None: `max_loras`).
    """

    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int | None


SECTIONS = {
    "load": LoadConfig,
    "cache": CacheConfig,
    "scheduling": SchedulingConfig,
    "parallel": ParallelConfig,
    "compile": CompileConfig,
    "lora": LoraConfig,
}
