"""The engine's resolved configuration: `EngineArgs` plus what start-up decides from the model.

Built once (`EngineConfig.resolve`, no JAX) and handed to the planner, the runner, the scheduler
and the server, so none of them re-derives a limit or re-reads the model's configuration.
`resolve` is the one step that looks at files: it checks the model directory (or preset), reads
its `config.json` once (and the draft model's, once), and checks the options that depend on them,
raising `EngineArgsError` naming the option. The pool size is the one thing only the devices can
decide: `with_blocks` adds it after planning.
"""

import dataclasses
import logging
import os

import numpy as np

from jaxpaged.checkpoint.format import TOKENIZER_FILES, WEIGHT_FILES, has_tokenizer, has_weights
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.presets import CONFIG_FILE, PRESETS, get_preset, load_config_dict
from jaxpaged.config.quantization import CheckpointQuantizationError, kv_dtype_name, resolve_quantization
from jaxpaged.core.scheduler import SchedulerConfig
from jaxpaged.engine_args import EngineArgs, EngineArgsError
from jaxpaged.parallel.sharding import TensorParallelError, TensorParallelLayout

logger = logging.getLogger("jaxpaged")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine runs with.

    Attributes:
      args: the options as given, with the seed resolved (never None).
      model: the checkpoint's configuration.
      max_model_len: the context limit, validated against the model.
      layout: how the model splits over the tensor-parallel devices.
      num_blocks: KV blocks per device, the null block included (0 until the pool is planned).
      num_host_blocks: blocks of the host tier (0: none; planned with the pool).
      quantization: the weights' quantization method (`quantization`, or the checkpoint's), or None.
      checkpoint_dtype: config.json's `dtype` (or `torch_dtype`): what `dtype` "auto" means (None:
        float32).
      draft: the draft model's configuration and checkpoint dtype (speculative decoding with a
        draft model), or None.
    """

    args: EngineArgs
    model: ModelConfig
    max_model_len: int
    layout: TensorParallelLayout
    num_blocks: int = 0
    num_host_blocks: int = 0
    quantization: str | None = None
    checkpoint_dtype: str | None = None
    draft: "DraftModel | None" = None

    @classmethod
    def resolve(cls, args: EngineArgs) -> "EngineConfig":
        """Resolves the seed ("random" draws one, logged so a run can be repeated), checks the
        model directory, reads its configuration (once) and checks the options against it: the
        context limit, the tensor-parallel split, the quantization, the draft model, the tokenizer.

        Raises:
          EngineArgsError: naming the option (`model`, `quantization`, `tensor_parallel_size`,
            `speculative_config`, `tokenizer`, `kv_cache_dir`).
          ValueError: an unsupported model configuration, or max_model_len beyond the model's
            limit or its sliding window.
        """
        if args.seed is None:
            args = dataclasses.replace(args, seed=int(np.random.SeedSequence().entropy % 2**31))
            logger.info("engine seed: %d (drawn at random)", args.seed)
        check_model_dir(args.model, args.load_format)
        raw = load_config_dict(args.model)[1]
        quantization = _quantization(args.model, args.quantization, raw)
        model = ModelConfig.from_hf(raw)
        layout = _layout(model, args.tensor_parallel_size)
        draft = None
        if args.speculative_config is not None and args.speculative_config.model is not None:
            draft = _draft_model(args, model)
        max_model_len = model.check_max_model_len(args.max_model_len or model.max_context_len)
        if args.kv_cache_dir is not None and os.path.exists(args.kv_cache_dir) and not os.path.isdir(args.kv_cache_dir):
            raise EngineArgsError("kv_cache_dir", args.kv_cache_dir, "exists and is not a directory")
        if not args.skip_tokenizer_init:
            _check_tokenizer(args)
        return cls(
            args,
            model,
            max_model_len,
            layout,
            quantization=quantization,
            checkpoint_dtype=checkpoint_dtype(raw),
            draft=draft,
        )

    def shared_settings(self) -> dict[str, str]:
        """What every process of a multi-process engine must run with, each as text: the options
        not marked `per_process` (the seed aside: the processes take the leader's) and the
        checkpoint's configuration (model paths may differ between machines; the model may not)."""
        settings = {
            f.name: repr(getattr(self.args, f.name))
            for f in dataclasses.fields(EngineArgs)
            if not f.metadata["per_process"] and f.name != "seed"
        }
        settings["model configuration"] = repr(self.model)
        # resolved values replace the options: a limit or method the checkpoint supplies may be
        # given on one process and left to the checkpoint on another
        settings["max_model_len"] = repr(self.max_model_len)
        settings["quantization"] = repr(self.quantization)
        return settings

    def kv_dtype(self, model_dtype) -> str:
        """The KV cache's (logical) dtype name: `kv_cache_dtype`, or with "auto" the model's."""
        return kv_dtype_name(self.args.kv_cache_dtype, str(model_dtype))

    def with_blocks(self, num_blocks: int, num_host_blocks: int | None = None) -> "EngineConfig":
        """This configuration with the planned pool size (and host tier, when given)."""
        host = self.num_host_blocks if num_host_blocks is None else num_host_blocks
        return dataclasses.replace(self, num_blocks=num_blocks, num_host_blocks=host)

    @property
    def preemption_mode(self) -> str:
        """`preemption_mode`, resolved: swap when there is a host tier, unless told otherwise."""
        return self.args.preemption_mode or ("swap" if self.num_host_blocks else "recompute")

    @property
    def speculative(self):
        """The speculative decoding options (`SpeculativeConfig`), or None."""
        return self.args.speculative_config

    def scheduler_config(self) -> SchedulerConfig:
        """What the scheduler needs (after planning), and so the runner: its buckets come from
        these limits and it fuses `num_scheduler_steps` decode steps."""
        a = self.args
        return SchedulerConfig(
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=a.block_size,
            num_blocks=self.num_blocks,
            enable_prefix_caching=a.enable_prefix_caching,
            num_host_blocks=self.num_host_blocks,
            preemption_mode=self.preemption_mode,
            num_scheduler_steps=a.num_scheduler_steps,
        )


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """The draft model of speculative decoding, resolved like the target.

    Attributes:
      path: its directory or preset (`speculative_config`'s "model").
      model: its configuration.
      checkpoint_dtype: what `dtype` "auto" means for it (None: float32).
    """

    path: str
    model: ModelConfig
    checkpoint_dtype: str | None


def checkpoint_dtype(raw: dict) -> str | None:
    """The dtype a config.json names (`dtype`, or transformers 4's `torch_dtype`), or None."""
    return raw.get("dtype") or raw.get("torch_dtype")


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


def _layout(model: ModelConfig, tensor_parallel_size: int) -> TensorParallelLayout:
    try:
        return TensorParallelLayout(model, tensor_parallel_size)
    except TensorParallelError as err:
        reason = str(err).removeprefix(f"tensor_parallel_size={tensor_parallel_size} ")
        raise EngineArgsError("tensor_parallel_size", tensor_parallel_size, reason) from None


def _draft_model(args: EngineArgs, target: ModelConfig) -> DraftModel:
    """The draft model, checked: readable like the target, the target's vocabulary and context,
    split over the same devices."""
    spec, field = args.speculative_config, "speculative_config"
    try:
        check_model_dir(spec.model, args.load_format)
        raw = load_config_dict(spec.model)[1]
        _quantization(spec.model, args.quantization, raw)
        draft = ModelConfig.from_hf(raw)
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
        draft.check_max_model_len(args.max_model_len or target.max_context_len)
    except ValueError as err:
        raise EngineArgsError(
            field, spec, f"the draft model: {err}; lower `max_model_len` or use a draft with the target's context"
        ) from None
    return DraftModel(spec.model, draft, checkpoint_dtype(raw))


def _check_tokenizer(args: EngineArgs) -> None:
    field, directory = ("tokenizer", args.tokenizer) if args.tokenizer else ("model", args.model)
    if not os.path.isdir(directory) or not has_tokenizer(directory):
        raise EngineArgsError(
            field,
            directory,
            f"has no tokenizer files ({', '.join(TOKENIZER_FILES)}); point `tokenizer` at a directory with them, or "
            "set `skip_tokenizer_init` to run on token ids",
        )
