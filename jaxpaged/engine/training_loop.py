"""The engine inside a training loop (reinforcement learning): vLLM's verbs for new weights, sleep
mode and pausing, on `LLMEngine` (which `LLM` forwards).

A trainer and the engine in one JAX process share devices and arrays: `get_params()` is the
engine's parameter state itself, `update_weights` takes the trainer's arrays where they lie (no
copy when they already have the engine's sharding), and the engine serves them from its next
step on. The step programs take the parameters as arguments (never donated, never baked in), so
new weights of the same shapes need no compilation.
"""

import logging
import time

import jax
from flax import nnx

from jaxpaged.engine.setup import build_model
from jaxpaged.lora_request import LoRARequest
from jaxpaged.model.lora import LoraAdapter, init_lora
from jaxpaged.worker import sleep as sleep_mode
from jaxpaged.worker.weight_update import WeightTarget, WeightUpdateStats

logger = logging.getLogger("jaxpaged")

PAUSE_MODES = ("abort", "keep")


class TrainingLoopControls:
    """`LLMEngine`'s methods for a training loop (mixed into it; they use its runner and
    scheduler)."""

    _slept: sleep_mode.Slept | None = None
    _paused: bool = False
    _weightless: bool = False  # slept at level 2 and no complete weights given since

    def get_params(self) -> nnx.State:
        """The engine's parameter state as the step programs read it (`nnx.State`; per-layer
        parameters as `LayerArrays` unless `scan_layers`; the mesh layout: kv heads repeated where
        there are more devices than kv heads; a quantized weight as its `<name>_quant` /
        `<name>_scale` pair, a group-quantized one with its `<name>_zero` too, and `<name>_perm`
        when act-ordered). `nnx.merge(graphdef, params)` is the model (`get_graphdef()`).
        These are the engine's arrays, not copies: do not delete or donate them.

        Raises:
          RuntimeError: asleep or without weights, or under pipeline parallelism."""
        self._check_one_stage("get_params")
        self._check_awake("get_params")
        return self.runner.params

    def get_graphdef(self) -> nnx.GraphDef:
        """The model's structure: `nnx.merge(get_graphdef(), get_params())` is the engine's model
        (for `jaxpaged.functional.token_logprobs`)."""
        return self.runner.step_programs.graphdef

    def update_weights(self, weights) -> WeightUpdateStats:
        """Replaces the engine's weights; the next step computes with them.

        Args:
          weights: either the parameter state as `get_params()` returns it (an `nnx.State` or
            its `nnx.to_pure_dict`: every array, same shapes and dtypes; `jax.Array`s already on
            the engine's devices with its sharding are taken without a copy, others are put
            there; an engine with quantized weights also takes a quantizable weight plain, in the
            model's dtype, and quantizes it), or an iterable of Hugging Face `(name, array)`
            pairs (vLLM's `load_weights`: any subset of the checkpoint's tensors, cast to the
            model's dtype, quantized where the engine quantizes).

        Returns:
          What was replaced, shared and copied (`WeightUpdateStats`).

        Raises:
          WeightUpdateError: (a ValueError) naming the parameter path or tensor and what was
            expected; the engine is unchanged.
          RuntimeError: the engine is asleep at level 1, runs over several processes or pipeline
            stages, or keeps KV on disk (`kv_cache_dir`).

        The prefix cache is reset (its KV was computed with the old weights), and the blocks
        of requests still running or swapped out are never cached. Those requests go on with
        the new weights (their earlier tokens' KV stays as computed); pause with
        `pause_generation("abort")` first to drop them. A step already dispatched (with async
        scheduling one is in flight between `step()` calls) finishes with the old weights: its
        tokens come with the next `step()`; every step after it computes with the new ones. The
        engine's references to the old arrays are gone when this returns (their memory is freed
        unless the caller or that step holds them).
        """
        if self._slept is not None and self._slept.level == 1:
            raise RuntimeError("the engine is asleep (level 1): call wake_up() before update_weights()")
        self._check_one_process("update_weights")
        self._check_one_stage("update_weights")
        if self.disk_tier is not None:  # its files hold KV of the checkpoint's weights, under their fingerprint
            raise RuntimeError(
                f"update_weights: the engine keeps KV on disk (kv_cache_dir={self.config.cache.kv_cache_dir!r}), "
                "computed with the checkpoint's weights and read back by later engines; start the engine "
                "without --kv-cache-dir to update its weights"
            )
        start = time.perf_counter()
        target = WeightTarget(self.runner.params, self.runner.parallel, self.runner.quantization)
        if isinstance(weights, (dict, nnx.State)):
            new, stats = target.from_tree(weights)
        else:
            new, stats = target.from_hf(weights)
        del target
        self.runner.update_params(new)
        self._weightless = self._weightless and sleep_mode.is_abstract(self.runner.params)
        self.reset_prefix_cache()
        logger.info(
            "weights updated in %.3f s: %d arrays (%d bytes shared, %d copied, %d quantized)",
            time.perf_counter() - start,
            stats.arrays,
            stats.shared_bytes,
            stats.copied_bytes,
            stats.quantized_bytes,
        )
        return stats

    def init_lora(self, rank: int, target_modules=None, seed: int = 0) -> LoraAdapter:
        """A new LoRA adapter for this engine's model, as PEFT initialises one (B zeros: it starts
        as the base model), in the layout `update_lora` takes (`model.lora.init_lora`).

        Args:
          rank: its rank (at most the engine's `max_lora_rank`).
          target_modules: the projections it adapts (`q_proj`, ...; default every one LoRA may).
          seed: its random A's seed.
        """
        mesh_config = self.config.layout.mesh_config
        adapter = init_lora(mesh_config, rank, jax.random.key(seed), target_modules, self.runner.params_dtype)
        return jax.device_put(adapter, self.runner.parallel.sharding())  # whole on every device, as the pool

    def update_lora(self, lora_name: str, adapter: LoraAdapter) -> LoRARequest:
        """Serves a trainer's LoRA adapter under `lora_name` from the next step on: requests made
        with the returned `LoRARequest` run with it (vLLM has no equivalent: its adapters come
        from files). The arrays are taken where they lie, with nothing read back to the host and
        no program compiled for them (their slot of the device's adapter pool is written in place
        when a request needs it: one device-side copy of the adapter). Called again with new
        arrays, the name's new version serves the requests added from then on; requests already
        added finish with the version they started with, and no cached prefix crosses versions.

        Args:
          lora_name: the adapter's name (not one read from a directory).
          adapter: `LoraAdapter` arrays of the mesh's shapes (`init_lora` makes one; a gradient
            step on one keeps its shapes).

        Raises:
          ValueError: LoRA is off, the name is a directory's adapter, or the arrays do not fit.
          RuntimeError: over several processes (the arrays live in this one).
        """
        if self.loras is None:
            raise ValueError("update_lora: the engine runs without LoRA; start it with enable_lora=True")
        self._check_one_process("update_lora")
        if not isinstance(adapter, LoraAdapter):
            raise ValueError(f"update_lora: give a LoraAdapter (init_lora makes one), got {type(adapter).__name__}")
        return self.loras.update(lora_name, adapter.a, adapter.b, self._loras_in_use())

    def reload_weights(self) -> None:
        """Reads the weights again from the checkpoint (or makes the seeded dummy weights again)
        and serves them (vLLM's `reload_weights`); the prefix cache is reset.

        Raises:
          RuntimeError: asleep at level 1, or over several processes or pipeline stages."""
        if self._slept is not None and self._slept.level == 1:
            raise RuntimeError("the engine is asleep (level 1): call wake_up() before reload_weights()")
        self._check_one_process("reload_weights")
        self._check_one_stage("reload_weights")
        if not self._weightless:  # the old weights go before the new ones arrive
            self.runner.drop_params()
        _, params = nnx.split(build_model(self.config, self.runner.parallel))
        self.runner.set_params(params)
        self._weightless = False
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix (vLLM's name): later requests compute their prompts again.
        Returns True."""
        self.scheduler.reset_prefix_cache()
        return True

    # -- sleep mode -----------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Frees the engine's device memory (vLLM's sleep mode): level 1 copies the weights to
        host memory and drops the KV pool; level 2 drops both (then `wake_up()` and give weights
        with `update_weights` or `reload_weights`). The prefix cache is reset.

        Raises:
          RuntimeError: requests are unfinished (finish or abort them, or
            `pause_generation("abort")`), the engine runs over several processes or pipeline
            stages, or it has a draft model.
          ValueError: a level other than 1 or 2.
        """
        sleep_mode.check_level(level)  # before anything changes, asleep or not
        if self._slept is not None:
            return
        self._check_one_process(f"sleep({level})")
        self._check_one_stage(f"sleep({level})")
        if self.runner.draft is not None:
            raise RuntimeError(
                f"sleep({level}): the engine has a draft model (speculative_config), whose weights and KV pool "
                "sleep mode does not free; start the engine without a draft model to use sleep mode"
            )
        if self.scheduler.has_unfinished():
            raise RuntimeError(
                f"sleep({level}) with {self.scheduler.num_running + self.scheduler.num_waiting} unfinished "
                "sequences; finish or abort them first (pause_generation('abort') aborts them)"
            )
        self._postprocess(self.runner.read_all())  # its sequences are finished: nothing to emit
        self.reset_prefix_cache()
        self._slept = self.runner.sleep(level)
        self._weightless = level == 2
        logger.info("engine asleep (level %d)", level)

    def wake_up(self) -> None:
        """Takes the device memory again: a fresh KV pool and, after level 1, the weights as they
        were. After level 2 the weights are still missing: `update_weights` (every array) or
        `reload_weights` gives them."""
        if self._slept is None:
            return
        slept, self._slept = self._slept, None
        self.runner.wake_up(slept)
        logger.info("engine awake%s", " (give weights: update_weights or reload_weights)" if slept.level == 2 else "")

    def is_sleeping(self) -> bool:
        return self._slept is not None

    # -- pausing --------------------------------------------------------------------------------

    def pause_generation(self, mode: str = "abort") -> None:
        """Stops scheduling (vLLM's `pause_generation`): with "abort" every unfinished request is
        aborted (its final output comes with the next `step()`); with "keep" requests stay where
        they are and go on after `resume_generation()`. New requests are queued meanwhile."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause_generation mode={mode!r} must be one of {PAUSE_MODES}")
        if mode == "abort":
            self.abort_request(self.unfinished_request_ids())
        self._paused = True

    def resume_generation(self) -> None:
        """Schedules again after `pause_generation`."""
        self._paused = False

    def is_paused(self) -> bool:
        return self._paused

    def _idle(self) -> bool:
        """Whether `step()` schedules nothing now (paused or asleep); a step that needs weights the
        engine does not have is refused."""
        if self._paused or self._slept is not None:
            return True
        if self._weightless and self.scheduler.has_unfinished():
            self._check_awake("step")
        return False

    def _check_one_process(self, what: str) -> None:
        """Refuses what the follower processes of a multi-process engine (`engine/follower.py`)
        cannot follow: they hold their own shards of the weights and KV pool, and the step channel
        carries only steps, so the processes would diverge. (Pausing and the prefix cache are the
        leader's scheduling alone and need no refusal.)"""
        if self.runner.channel is not None:
            raise RuntimeError(
                f"{what} is not supported for an engine over several processes (--nnodes): the follower "
                "processes hold their own shards of the weights and KV pool and receive only steps, so "
                "they would diverge from process 0"
            )

    def _check_one_stage(self, what: str) -> None:
        """Refuses what does not know pipeline stages yet: each stage's devices hold only its
        layers' slots (`jaxpaged.parallel.pipeline`), not the parameter state these calls read,
        replace or move. (`wake_up` needs no refusal: nothing sleeps.)"""
        stages = self.config.layout.pipeline.size
        if stages > 1:
            raise RuntimeError(
                f"{what} is not supported with pipeline parallelism yet (pipeline_parallel_size={stages}): each "
                "stage holds only its own layers; start the engine with pipeline_parallel_size=1 for a training loop"
            )

    def _check_awake(self, what: str) -> None:
        if self._slept is not None:
            raise RuntimeError(f"{what}: the engine is asleep; call wake_up() first")
        if self._weightless:
            raise RuntimeError(
                f"{what}: the engine has no weights (slept at level 2); give them with update_weights() or reload_weights()"
            )
