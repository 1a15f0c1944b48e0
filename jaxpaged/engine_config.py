"""The engine's resolved configuration: `EngineArgs` plus what start-up decides from the model.

Built once (`EngineConfig.resolve`, no JAX) and handed to the planner, the runner, the scheduler
and the server, so none of them re-derives a limit or re-reads the model's configuration. The
pool size is the one thing only the devices can decide: `with_blocks` adds it after planning.
"""

import dataclasses
import logging

import numpy as np

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.presets import load_config_dict
from jaxpaged.config.quantization import kv_dtype_name, resolve_quantization
from jaxpaged.core.scheduler import SchedulerConfig
from jaxpaged.engine_args import EngineArgs
from jaxpaged.parallel.sharding import TensorParallelLayout

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
    """

    args: EngineArgs
    model: ModelConfig
    max_model_len: int
    layout: TensorParallelLayout
    num_blocks: int = 0
    num_host_blocks: int = 0
    quantization: str | None = None

    @classmethod
    def resolve(cls, args: EngineArgs) -> "EngineConfig":
        """Resolves the seed ("random" draws one, logged so a run can be repeated), reads the
        model's configuration and checks the context limit against it.

        Raises:
          ValueError: max_model_len beyond the model's limit or its sliding window.
        """
        if args.seed is None:
            args = dataclasses.replace(args, seed=int(np.random.SeedSequence().entropy % 2**31))
            logger.info("engine seed: %d (drawn at random)", args.seed)
        raw = load_config_dict(args.model)[1]
        model = ModelConfig.from_hf(raw)
        max_model_len = model.check_max_model_len(args.max_model_len or model.max_context_len)
        return cls(
            args,
            model,
            max_model_len,
            TensorParallelLayout(model, args.tensor_parallel_size),
            quantization=resolve_quantization(args.quantization, raw),
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

    def scheduler_config(self) -> SchedulerConfig:
        """What the scheduler needs (after planning)."""
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
