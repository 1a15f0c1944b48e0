"""Engine configuration with vLLM's argument names: the one declaration of every engine option.

Each field carries its help text (and, where it has them, its choices) in its metadata. `LLM`
takes the fields as keyword arguments, and `jaxpaged generate` / `jaxpaged serve` derive their
engine flags from them (`--max-num-seqs` for `max_num_seqs`, see `jaxpaged.entrypoints.cli_flags`), so a
new option is declared here once. No JAX here: arguments are checked before anything slow.
"""

import dataclasses
import os

from jaxpaged.config import defaults
from jaxpaged.config.attention import ATTENTION_BACKENDS
from jaxpaged.config.checks import (
    OptionError,
    check_batch_limits,
    check_block_size,
    check_choice,
    check_memory_fraction,
)
from jaxpaged.config.defaults import MAX_COMPILE_THREADS
from jaxpaged.config.kv_events import KVEventsConfig, KVEventsConfigError
from jaxpaged.config.presets import PRESETS
from jaxpaged.config.quantization import (
    DEFAULT_GROUP_SIZE,
    KV_CACHE_DTYPES,
    QUANTIZATION_METHODS,
)
from jaxpaged.config.speculative import SpeculativeConfig, SpeculativeConfigError
from jaxpaged.core.scheduler import PREEMPTION_MODES
from jaxpaged.parallel.pipeline import PipelineParallelError, parse_partition

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")


class EngineArgsError(OptionError):
    """An engine option with a bad value; `field` is the `EngineArgs` field (see `OptionError`)."""


def pipeline_error(err: PipelineParallelError, value) -> EngineArgsError:
    """A layer split's error (`jaxpaged.parallel.pipeline`) on the option it names
    (`pipeline_parallel_size` or `pp_layer_partition`), whose value is `value`."""
    field, _, rest = str(err).partition("=")  # "FIELD=VALUE must ..." or "FIELD=VALUE exceeds ..."
    reason = min(i for i in (rest.find(" must "), rest.find(" exceeds ")) if i >= 0)
    return EngineArgsError(field, value, rest[reason + 1 :])


def default_compilation_cache_dir() -> str:
    """Where `compilation_cache_dir="auto"` keeps compiled programs: per user, like vLLM's cache."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "jaxpaged", "xla")


MAX_SEED = 2**62  # the processes of a multi-process engine pass the seed as two 31-bit words


def _option(
    default,
    help: str,
    *,
    choices: tuple | None = None,
    metavar: str | None = None,
    per_process: bool = False,
    aliases: tuple[str, ...] = (),
    compatibility: bool = False,
    refused: bool = False,
    flag: bool = True,
):
    """A field: its default, its `--help` text, `per_process` when the processes of one
    multi-process engine may set it differently (paths, local resources; the others must agree),
    its flag's `aliases` besides `--field-name` (vLLM's short forms, e.g. `-tp`), and
    `compatibility` for an option accepted only so that vLLM's arguments run unchanged (its help
    says what it means here; logged when set: `compatibility_notes`), and `refused` for a vLLM
    option jaxpaged cannot honour: any value but the default is an error whose reason is `help`
    (clearer than an unknown flag); `flag` False for a field the entry points set, which has no
    command-line flag."""
    if compatibility:
        help = f"accepted for vLLM compatibility; changes nothing: {help}"
    if refused:
        help = f"vLLM's option, refused here: {help}"
    metadata = dict(
        help=help,
        choices=choices,
        metavar=metavar,
        per_process=per_process,
        aliases=aliases,
        compatibility=compatibility,
        refused=refused,
        flag=flag,
    )
    return dataclasses.field(default=default, metadata=metadata)


def compatibility_notes(args: "EngineArgs") -> list[str]:
    """One line for each vLLM-compatibility option `args` sets: what it means here (for the log)."""
    return [
        f"{f.name}: {f.metadata['help']}"
        for f in dataclasses.fields(args)
        if f.metadata["compatibility"] and getattr(args, f.name) != f.default
    ]


@dataclasses.dataclass
class EngineArgs:
    """Everything `LLM(...)` and `jaxpaged serve` accept (vLLM's names and defaults).

    Every field's meaning is its `help` metadata, shown by `jaxpaged serve --help`:
    `{f.name: f.metadata["help"] for f in dataclasses.fields(EngineArgs)}`.
    """

    model: str = _option(
        None,
        "model directory (Hugging Face or jaxpaged-convert); with --load-format dummy also a directory "
        f"holding only config.json, or a preset ({', '.join(PRESETS)}); '{defaults.DEMO_MODEL_NAME}' is the "
        "demo model shipped in the package",
        metavar="DIR",
        per_process=True,
    )
    tokenizer: str | None = _option(
        None, "tokenizer directory (default: the model directory)", metavar="DIR", per_process=True
    )
    dtype: str = _option(defaults.DTYPE, "weights and activations dtype; auto is the checkpoint's", choices=DTYPES)
    kv_cache_dtype: str = _option(
        defaults.KV_CACHE_DTYPE,
        "KV cache dtype: auto is the model's dtype; fp8 (= fp8_e4m3) and fp8_e5m2 store 1 byte per element "
        "(twice the tokens of bfloat16), quantized with a scale per layer and kv head: a compressed-tensors checkpoint's "
        "k_scale/v_scale, else 1",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str | None = _option(
        None,
        "weight quantization: fp8 (float8 e4m3 weights with a scale per output channel, activations "
        "quantized per token), int8 (weight-only, a scale per output channel) or int4 (weight-only, 4 bits "
        "rounded to nearest at load, a scale and a zero point per group of --quantization-group-size inputs); "
        "a compressed-tensors FP8 checkpoint is read as fp8, and an AWQ, GPTQ or compressed-tensors pack-quantized "
        "one 4/8-bit, without it; awq, gptq and compressed-tensors assert the checkpoint's format (default: none)",
        choices=QUANTIZATION_METHODS,
    )
    quantization_group_size: int = _option(
        DEFAULT_GROUP_SIZE,
        "input features per group of --quantization int4 (a scale and a zero point each; must divide every "
        "projection's inputs)",
    )
    max_model_len: int | None = _option(None, "longest prompt + output in tokens (default: the model's limit)")
    gpu_memory_utilization: float = _option(
        defaults.GPU_MEMORY_UTILIZATION,
        "fraction of GPU memory for weights, activations and the KV cache",
        per_process=True,
    )
    kv_cache_memory_bytes: int | None = _option(
        None,
        "exact KV cache size, e.g. 4GiB or 4294967296, a draft model's pool included (default: sized from the "
        "device's memory, or on a CPU from max_num_seqs x max_model_len)",
        metavar="BYTES",
        per_process=True,
    )
    block_size: int = _option(defaults.BLOCK_SIZE, "tokens per KV cache block (a power of two)")
    max_num_seqs: int | None = _option(
        None,
        "most sequences running at once (default: vLLM's for the device: 1024 on a GPU of at least 70 GiB other "
        f"than an A100, else 256; {defaults.MAX_NUM_SEQS} on a CPU)",
    )
    max_num_batched_tokens: int | None = _option(
        None,
        "most tokens computed per step (default: vLLM's for the device and the entry point: on a GPU of at least "
        "70 GiB other than an A100 16384 for LLM and 8192 for jaxpaged serve, else 8192 and 2048, at most "
        f"max_num_seqs x max_model_len; on a CPU max({defaults.MIN_MAX_NUM_BATCHED_TOKENS}, max_num_seqs))",
    )
    enable_prefix_caching: bool = _option(defaults.ENABLE_PREFIX_CACHING, "reuse the KV cache of equal prompt prefixes")
    kv_offloading_size: float | None = _option(
        None,
        "GiB of host memory for a host tier of the KV cache: blocks evicted from the device prefix cache "
        "are kept there and copied back on a prefix hit, and preempted sequences are swapped there "
        "(default: no host tier)",
        metavar="GIB",
    )
    kv_cache_dir: str | None = _option(
        None,
        "directory for a disk tier of the KV cache: prefix blocks are also written there and a later engine "
        "with the same model, dtype and block size reads them instead of computing them (needs "
        "--kv-offloading-size; default: no disk tier)",
        metavar="DIR",
    )
    kv_cache_dir_size: float = _option(
        16.0,
        "GiB of files the disk tier keeps in --kv-cache-dir for this model (least recently used removed first)",
        metavar="GIB",
    )
    kv_events_config: KVEventsConfig | dict | str | None = _option(
        None,
        "publish the prefix cache's KV events in vLLM's format, as JSON: {\"enable_kv_cache_events\": true, "
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": null, "topic": ""}: every block '
        "stored on the device or in the host tier and every eviction, over a ZeroMQ PUB socket (what vLLM's "
        "router follows with --policy kv_aware; needs the server extra); with --enable-prefix-caching "
        "(default: off)",
        metavar="JSON",
    )
    preemption_mode: str | None = _option(
        None,
        "what a preempted sequence loses: recompute frees its blocks and computes them again on resume; "
        "swap copies them to the host tier and back (needs --kv-offloading-size; recompute when the tier is "
        "full) (default: swap with a host tier, else recompute)",
        choices=PREEMPTION_MODES,
    )
    seed: int | None = _option(
        0,
        "engine seed: requests without their own seed draw one from it, so a run repeats; "
        "'random' (None) draws a fresh seed every run",
        metavar="N|random",
    )
    generation_config: str = _option(
        "auto",
        "default sampling parameters (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) "
        "for requests that do not set them: 'auto' from the model's generation_config.json, 'vllm' "
        "SamplingParams' own defaults, or a directory holding a generation_config.json",
        metavar="auto|vllm|DIR",
    )
    load_format: str = _option(
        "auto", "auto reads the weights; dummy makes random weights of the model's shapes", choices=LOAD_FORMATS
    )
    tensor_parallel_size: int = _option(
        defaults.TENSOR_PARALLEL_SIZE,
        "devices to split the model over (Megatron tensor parallelism); must divide the attention heads",
        aliases=("-tp",),
    )
    pipeline_parallel_size: int = _option(
        defaults.PIPELINE_PARALLEL_SIZE,
        "stages the decoder layers are split into, in contiguous runs, each stage on its own "
        "--tensor-parallel-size devices (TP x PP devices in all; with --nnodes, a stage per machine); each "
        "device holds its stage's layers' weights and KV blocks, and every stage the embedding and LM head",
        aliases=("-pp",),
    )
    pp_layer_partition: str | tuple[int, ...] | list[int] | None = _option(
        None,
        "decoder layers of each pipeline stage, first to last, comma-separated, e.g. 20,12 for 32 layers over "
        "--pipeline-parallel-size 2 (vLLM reads this from the environment variable VLLM_PP_LAYER_PARTITION) "
        "(default: balanced, the first stages taking one layer more when the count does not divide)",
        metavar="N,N,...",
    )
    enable_expert_parallel: bool = _option(
        False,
        "split a mixture of experts' experts over the --tensor-parallel-size devices (whole experts "
        "on each) instead of splitting every expert's FFN width; attention stays tensor parallel",
    )
    data_parallel_size: int = _option(
        1,
        "jaxpaged serve: engine replicas behind the one API server, each on its own --tensor-parallel-size x "
        "--pipeline-parallel-size devices (replica r takes the r-th group of CUDA_VISIBLE_DEVICES), each "
        "request sent to the least loaded replica",
        aliases=("-dp",),
    )
    data_parallel_rank: int = _option(
        0, "this replica among --data-parallel-size (the server sets it for each)", flag=False, per_process=True
    )
    nnodes: int = _option(1, "processes (machines) the engine spans; each runs jaxpaged serve with its own --node-rank")
    node_rank: int = _option(
        0,
        "this process among --nnodes: 0 schedules and serves, the others run its steps on their devices",
        per_process=True,
    )
    master_addr: str = _option(
        "127.0.0.1",
        "address of process 0, where the processes meet (with --nnodes > 1)",
        metavar="HOST",
        per_process=True,
    )
    master_port: int = _option(
        29501, "port of process 0 where the processes meet (with --nnodes > 1)", metavar="PORT", per_process=True
    )
    compilation_cache_dir: str = _option(
        "auto",
        "persistent compilation cache: later start-ups load the compiled step programs from it; auto is "
        "JAX's own cache directory when one is set, else $XDG_CACHE_HOME/jaxpaged/xla (~/.cache/jaxpaged/xla); "
        "none turns it off",
        metavar="DIR|auto|none",
        per_process=True,
    )
    attention_backend: str = _option(
        defaults.ATTENTION_BACKEND,
        "auto is the Pallas kernels on a GPU and the jnp reference elsewhere; pallas on a CPU "
        "interprets the kernels (slow)",
        choices=ATTENTION_BACKENDS,
    )
    scan_layers: bool = _option(
        defaults.SCAN_LAYERS,
        "compile the decoder layers as one loop body over stacked weights: programs compile several times "
        "faster, but every step copies each layer's weights out of the stack before its matmuls (XLA does on a CPU "
        "and, with its Triton GEMMs, on an H100), so decoding is slower; default: the layers unrolled over "
        "per-layer arrays, each weight read where it lies",
    )
    compile_threads: int | None = _option(
        None,
        "threads compiling the step programs at start-up (default: one per two CPU cores, at most "
        f"{MAX_COMPILE_THREADS}: XLA's compiler already uses about two cores per program; each thread holds one "
        "program's compiler memory)",
        per_process=True,
    )
    speculative_config: SpeculativeConfig | dict | str | None = _option(
        None,
        'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} proposes the tokens that followed the latest earlier '
        "occurrence of a sequence's last tokens, and the model checks them all in one step; a step speculates only "
        "while that has been faster than plain decoding at its batch size (measured), and never with more than "
        '"disable_by_batch_size" sequences running (default: off)',
        metavar="JSON",
    )
    num_scheduler_steps: int = _option(
        defaults.NUM_SCHEDULER_STEPS,
        "decode steps fused into one device program when every sequence decodes and none waits (and none "
        "filters with top-k/top-p or asks for top logprobs); 1: none. Under pipeline parallelism none fuse: the "
        "micro-batches in flight keep every stage busy instead",
    )
    async_scheduling: bool = _option(
        True,
        "schedule and dispatch each step before the previous one's tokens reach the host, which the device "
        "passes from step to step, so host work overlaps the device's (the same tokens as without it); a step "
        "that speculates waits for the previous one (proposals are made from its tokens)",
    )
    skip_tokenizer_init: bool = _option(
        False, "run without a tokenizer: token-id prompts in, token ids out, no stop strings", per_process=True
    )
    trust_remote_code: bool = _option(
        False,
        "jaxpaged runs no code from a model directory; its architectures are built in (config/architectures)",
        per_process=True,
        compatibility=True,
    )
    enforce_eager: bool = _option(
        False,
        "vLLM's switch from CUDA graphs to eager mode; jaxpaged always runs its compiled XLA step programs",
        per_process=True,
        compatibility=True,
    )
    enable_chunked_prefill: bool = _option(
        True,
        "jaxpaged always chunks long prompts into steps of --max-num-batched-tokens tokens, mixed with decodes",
        per_process=True,
        compatibility=True,
    )
    swap_space: float = _option(
        4.0,
        "vLLM's CPU swap space (GiB); jaxpaged swaps preempted sequences to the host tier of the KV cache, "
        "sized by --kv-offloading-size",
        per_process=True,
        compatibility=True,
    )
    revision: str | None = _option(
        None,
        "jaxpaged reads local directories and downloads nothing: download the revision you want "
        "(hf download ID --revision REV --local-dir DIR) and give that directory as the model",
        metavar="REV",
        per_process=True,
        refused=True,
    )
    enable_lora: bool = _option(
        False,
        "serve LoRA adapters (PEFT's format) over the base model: a request names its adapter (LLM: "
        "lora_request=LoRARequest(...)); up to --max-loras adapters in one batch",
    )
    max_loras: int = _option(1, "LoRA adapters on the device at once (slots of the adapter pool); with --enable-lora")
    max_lora_rank: int = _option(
        16, "largest LoRA rank an adapter may have (the pool's slots are this wide); with --enable-lora"
    )
    max_cpu_loras: int | None = _option(
        None,
        "LoRA adapters kept read in host memory, least recently used evicted (default: --max-loras); with "
        "--enable-lora",
        metavar="N",
    )
    max_logprobs: int = _option(
        defaults.MAX_LOGPROBS,
        f"most logprobs a request may ask for, per token (at most {defaults.MAX_LOGPROBS}: what the sampler returns)",
    )
    usage_context: str = _option(
        "llm_class",
        "who starts the engine, as vLLM's UsageContext: llm_class (LLM, jaxpaged generate and bench) or "
        "openai_api_server (jaxpaged serve, which sets it); picks vLLM's default batch limits (max_num_seqs, "
        "max_num_batched_tokens), the server's token budget being smaller",
        choices=defaults.USAGE_CONTEXTS,
        flag=False,
    )

    def __post_init__(self):
        """Checks every option's type and range, and the options against each other; reads no
        file (`EngineConfig.resolve` checks the model directory and reads its configuration).

        Raises:
          EngineArgsError: naming the option.
        """
        if self.model == defaults.DEMO_MODEL_NAME:
            self.model = defaults.DEMO_MODEL_DIR
        try:
            self._check()
        except OptionError as err:
            if isinstance(err, EngineArgsError):
                raise
            raise EngineArgsError(err.field, err.value, err.reason) from None

    def _check(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise EngineArgsError("model", self.model, "give a model directory")
        for f in dataclasses.fields(self):
            if f.metadata["refused"] and getattr(self, f.name) != f.default:
                raise EngineArgsError(f.name, getattr(self, f.name), f.metadata["help"])
        if not isinstance(self.max_logprobs, int) or not 0 <= self.max_logprobs <= defaults.MAX_LOGPROBS:
            raise EngineArgsError(
                "max_logprobs", self.max_logprobs, f"must be an integer from 0 to {defaults.MAX_LOGPROBS}"
            )
        for name, allowed in (
            ("dtype", DTYPES),
            ("load_format", LOAD_FORMATS),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("attention_backend", ATTENTION_BACKENDS),
        ):
            check_choice(name, getattr(self, name), allowed)
        for name in (
            "block_size",
            "num_scheduler_steps",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "nnodes",
            "data_parallel_size",
            "quantization_group_size",
        ):
            self._check_int(name, 1)
        self._check_int("node_rank", 0)
        self._check_int("data_parallel_rank", 0)
        if self.data_parallel_rank >= self.data_parallel_size:
            raise EngineArgsError(
                "data_parallel_rank",
                self.data_parallel_rank,
                f"must be below data_parallel_size ({self.data_parallel_size})",
            )
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise EngineArgsError(
                "data_parallel_size",
                self.data_parallel_size,
                f"replicas of an engine that spans several processes (nnodes={self.nnodes}) are not supported yet; "
                "run one jaxpaged serve per group of machines behind vllm-router (docs/server.md)",
            )
        if self.node_rank >= self.nnodes:
            raise EngineArgsError("node_rank", self.node_rank, f"must be below nnodes ({self.nnodes})")
        if not 0 < self.master_port < 65536 or isinstance(self.master_port, bool):
            raise EngineArgsError("master_port", self.master_port, "must be a TCP port (1-65535)")
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_cache_memory_bytes",
            "compile_threads",
        ):
            if getattr(self, name) is not None:
                self._check_int(name, 1)
        if self.seed is not None:
            self._check_int("seed", 0)
            if self.seed >= MAX_SEED:
                raise EngineArgsError("seed", self.seed, f"must be below 2**62 ({MAX_SEED})")
        self._check_offloading()
        self._check_lora()
        self._check_pipeline()
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise EngineArgsError(
                "quantization", self.quantization, f"must be one of {', '.join(QUANTIZATION_METHODS)} (or unset)"
            )
        try:
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        except SpeculativeConfigError as err:
            raise EngineArgsError("speculative_config", self.speculative_config, str(err)) from None
        if self.speculative_config is not None and self.speculative_config.model is not None:
            self._check_draft_model()
        try:
            self.kv_events_config = KVEventsConfig.parse(self.kv_events_config)
        except KVEventsConfigError as err:
            raise EngineArgsError("kv_events_config", self.kv_events_config, str(err)) from None
        events = self.kv_events_config
        if events is not None and events.enable_kv_cache_events and not self.enable_prefix_caching:
            raise EngineArgsError(
                "kv_events_config", events, "announces prefix-cache blocks: it needs `enable_prefix_caching` on"
            )
        check_block_size(self.block_size)
        check_memory_fraction(self.gpu_memory_utilization)
        if not isinstance(self.compilation_cache_dir, str) or not self.compilation_cache_dir:
            raise EngineArgsError(
                "compilation_cache_dir", self.compilation_cache_dir, "must be a directory, 'auto' or 'none'"
            )
        if self.compile_threads is None:
            self.compile_threads = max(1, min((os.cpu_count() or 1) // 2, MAX_COMPILE_THREADS))
        if self.max_num_seqs is not None and self.max_num_batched_tokens is not None:
            check_batch_limits(self.max_num_seqs, self.max_num_batched_tokens)
        check_choice("usage_context", self.usage_context, defaults.USAGE_CONTEXTS)

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
                raise EngineArgsError(name, value, "must be an integer from 1 to 1024")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras):
            raise EngineArgsError(
                "max_cpu_loras", cpu, f"must be an integer of at least --max-loras ({self.max_loras})"
            )
        if self.enable_lora and self.pipeline_parallel_size > 1:
            raise EngineArgsError(
                "enable_lora",
                True,
                f"LoRA adapters under pipeline parallelism (pipeline_parallel_size={self.pipeline_parallel_size}) "
                "are not supported yet; use tensor parallelism",
            )
        if self.enable_lora and self.nnodes > 1:
            raise EngineArgsError(
                "enable_lora",
                True,
                f"LoRA adapters over several processes (nnodes={self.nnodes}) are not supported yet",
            )
        if self.enable_lora and self.speculative_config is not None:
            raise EngineArgsError(
                "enable_lora", True, "LoRA adapters with speculative decoding are not supported yet; drop one"
            )

    def _check_offloading(self) -> None:
        size = self.kv_offloading_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < 2**20):
            raise EngineArgsError("kv_offloading_size", size, "must be a positive number of GiB")
        if self.preemption_mode is not None:
            check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if self.preemption_mode == "swap" and size is None:
            raise EngineArgsError("preemption_mode", "swap", "swaps to the host tier: set `kv_offloading_size` too")
        if self.kv_cache_dir is not None:
            if not isinstance(self.kv_cache_dir, str) or not self.kv_cache_dir:
                raise EngineArgsError("kv_cache_dir", self.kv_cache_dir, "must be a directory")
            if size is None:
                raise EngineArgsError(
                    "kv_cache_dir",
                    self.kv_cache_dir,
                    "reads and writes through the host tier: set `kv_offloading_size` too",
                )
            if not self.enable_prefix_caching:
                raise EngineArgsError(
                    "kv_cache_dir",
                    self.kv_cache_dir,
                    "keeps prefix-cache blocks: it does nothing with `enable_prefix_caching` off",
                )
        disk = self.kv_cache_dir_size
        if isinstance(disk, bool) or not isinstance(disk, (int, float)) or not 0 < disk < 2**30:
            raise EngineArgsError("kv_cache_dir_size", disk, "must be a positive number of GiB")
        if size is not None and self.nnodes > 1:
            raise EngineArgsError(
                "kv_offloading_size",
                size,
                "is not supported across several processes yet (`nnodes` > 1); leave it unset",
            )

    def _check_pipeline(self) -> None:
        """The layer partition's form (`pp_layer_partition`, kept as text: "20,12"; a sequence of
        ints is taken too), and what pipeline parallelism does not work with. The layer counts
        against the model's: `EngineConfig.resolve`."""
        part = self.pp_layer_partition
        if part is not None and not isinstance(part, str):
            if not isinstance(part, (list, tuple)) or not all(isinstance(p, int) for p in part):
                raise EngineArgsError("pp_layer_partition", part, "must be layer counts, e.g. '20,12' or (20, 12)")
            self.pp_layer_partition = part = ",".join(map(str, part))
        try:
            parse_partition(part)
        except PipelineParallelError as err:
            raise pipeline_error(err, part) from None
        if self.pipeline_parallel_size > 1 and self.scan_layers:
            raise EngineArgsError(
                "scan_layers",
                True,
                f"pipeline parallelism (`pipeline_parallel_size`={self.pipeline_parallel_size}) runs its stages' "
                "layers unrolled; drop `scan_layers`",
            )

    def _check_draft_model(self) -> None:
        """What a draft model cannot be combined with (its files: `EngineConfig.resolve`)."""
        spec, field = self.speculative_config, "speculative_config"
        if self.kv_offloading_size is not None:
            raise EngineArgsError(
                field, spec, "a draft model does not work with the host tier yet; leave `kv_offloading_size` unset"
            )
        if self.nnodes > 1:
            raise EngineArgsError(field, spec, "a draft model does not work across several processes yet (`nnodes`)")
        if self.pipeline_parallel_size > 1:
            raise EngineArgsError(
                field,
                spec,
                "a draft model does not work with pipeline parallelism yet (`pipeline_parallel_size` > 1); "
                'use {"method": "ngram"}, or a `pipeline_parallel_size` of 1',
            )

    def _check_int(self, name: str, minimum: int) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise EngineArgsError(name, value, f"must be an integer of at least {minimum}")
