"""The device side of the engine: parameters, the cache, the compiled step programs, one
transfer per step in and one copy of its results out.

The runner owns a step from dispatch to the moment it may be read; the engine asks it in three
calls per step (`jaxpaged.engine.llm_engine`):

  `read_before_schedule`  the steps in flight that the next schedule must see read (it proposes,
                          or a running grammar needs its sequence's last token), else none;
  `execute`               carries out a `SchedulerOutput` (the host tier's copies, the slots it
                          frees and takes in the `InputBatch`, the packed step, the model and
                          sampler programs dispatched, the results' copy to the host started)
                          without waiting for the device, and hands over the steps dispatched
                          before it: the engine reads them while this one runs (async
                          scheduling);
  `sample`                dispatches the samplers of the step just executed whose token masks
                          had to wait (grammars: the masks follow the tokens just read, so the
                          host's mask work overlaps the device's forward pass), and hands the
                          step over at once when it must be read now (no async scheduling,
                          proposals checked, a draft model to propose from its tokens).

`fetch` waits for a handle's results (and, with a draft model, has it propose for the next step
from them); `read_all` hands over everything dispatched (paused, asleep). The parameters and the
pool are the runner's: `replace_params`, `drop_params`, `sleep` and `wake_up` change them.

The programs (`StepPrograms`: a mixed step per token bucket, decode steps and fused decode steps
per decode bucket, the samplers) are all compiled by `warm_up`, so nothing compiles while serving.
"""

import dataclasses
import logging
import time
import typing
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx

from jaxpaged.core.host_tier import KVTransfers
from jaxpaged.core.scheduler import SchedulerOutput
from jaxpaged.core.step_inputs import ScheduledSequence
from jaxpaged.engine_config import EngineConfig
from jaxpaged.functional import DeviceCache, init_cache
from jaxpaged.model import Llama
from jaxpaged.model.layer_arrays import place_params, state_shardings
from jaxpaged.model.lora import write_slot
from jaxpaged.model.prompt_logprobs import unpack_prompt_logprobs
from jaxpaged.model.sampler import SamplerOptions
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.parallel.multihost import EXECUTE, SEED, StepChannel
from jaxpaged.structured.constraint import fill_bitmask
from jaxpaged.structured.llg import llguidance
from jaxpaged.worker import sleep as sleep_mode
from jaxpaged.worker.input_batch import InputBatch
from jaxpaged.worker.kv_transfer import KVTransfer
from jaxpaged.worker.step_programs import Program, ResultLayout, SamplerProgram, StepPrograms, compile_all, sampler_for
from jaxpaged.worker.weight_update import Key, replace_params

logger = logging.getLogger("jaxpaged")


@dataclasses.dataclass
class StepHandle:
    """A dispatched step: its schedule and its results, still on the device (being copied).

    Attributes:
      output: what the scheduler planned.
      packed: the results, one int32 vector (`[steps, N]` for fused steps).
      layout: how to read them.
      prompt_packed: with prompt logprobs, `[T, 2 + 2L]` per token (see
        `jaxpaged.model.prompt_logprobs`), else None.
      pending: a step whose sampler waits for its token masks (`ModelRunner.dispatch_sampler`); `packed`
        is None until then.
    """

    output: SchedulerOutput
    packed: jax.Array | None
    layout: ResultLayout
    prompt_packed: jax.Array | None = None
    pending: "PendingSample | None" = None


@dataclasses.dataclass
class PendingSample:
    """The sampler half of a masked step, its model half already dispatched.

    Attributes:
      sampler: the compiled sampler program.
      logits: the model program's logits at the sampling rows.
      sampler_input: the model program's `SamplerInput` (its `token_mask` still to come).
      mask: `[rows, W]` int32, the packed buffer's mask (all ones until filled).
      entries: the indices of the constrained entries.
    """

    sampler: object
    logits: jax.Array
    sampler_input: typing.Any
    mask: np.ndarray
    entries: list[int]


@dataclasses.dataclass
class StepResult:
    """A step's results on the host, per scheduled entry.

    Attributes:
      tokens: each entry's sampled tokens: one, or the accepted proposals and the token after
        them, or a fused window's (its `live_steps`); empty for entries that sample nothing.
      values: the fetched arrays by name (`ResultLayout.unpack`), `[steps, rows, ...]`.
      rows_per_seq: R (sampling rows per sequence).
      num_drafts: proposals checked per entry.
      num_accepted: proposals kept per entry (speculative decoding), else None.
      proposals: a draft model's k tokens after the new tokens of each `drafting` entry, by
        seq_id (for the next step to check).
      prompt_logprobs: by entry index, the prompt logprobs its step computed: `(first prompt
        index, logprobs [N], ranks [N], top_ids [N, L], top_logprobs [N, L])`, entry j of
        the arrays being prompt token `first + j`'s (it follows token `first + j - 1`).
    """

    tokens: list[list[int]]
    values: dict[str, np.ndarray]
    rows_per_seq: int
    num_drafts: list[int]
    num_accepted: list[int] | None
    proposals: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    prompt_logprobs: dict[int, tuple] = dataclasses.field(default_factory=dict)

    def sample(self, i: int, j: int) -> dict[str, typing.Any]:
        """Entry i's j-th token's entries of every fetched array."""
        if self.num_accepted is not None:  # one step, R rows per sequence
            return {k: v[0, i * self.rows_per_seq + j] for k, v in self.values.items() if k != "num_accepted"}
        return {k: v[j, i * self.rows_per_seq] for k, v in self.values.items()}


class ModelRunner:
    """Runs engine steps on the device.

    Args:
      model: the NNX model (split once; its params are placed by the sharding table).
      parallel: the mesh and sharding table (one device: `TensorParallel.create(config)`).
      config: the engine's configuration, planned: the pool's `num_blocks` (the null block
        included), the scheduler's limits, `num_scheduler_steps` decode steps fused into one
        program when a batch is all decodes (1: no fusing). The pool holds `kv_cache_dtype`
        (the model's dtype with "auto"), stored in its `kv_storage_dtype`.
      kv_scales: an fp8 pool's `(k_scale [L], v_scale [L])`, e.g. a checkpoint's; None: 1.
      eos_token_ids: the ids banned before a request's `min_tokens`.
      fused_options: the sampler paths of the fused decode programs.
    """

    def __init__(
        self,
        model: Llama,
        *,
        parallel: TensorParallel,
        config: EngineConfig,
        kv_scales: tuple[np.ndarray, np.ndarray] | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        fused_options: SamplerOptions = SamplerOptions(),
    ):
        limits = config.scheduler_config()  # the scheduler's limits are the runner's
        self.config = model.config
        self.pipeline = config.layout.pipeline
        self.pool_config = model.pool_config  # under pipeline parallelism: every stage's layer slots
        self.num_decode_steps = limits.num_scheduler_steps
        self.parallel = parallel
        self.block_size = limits.block_size
        self.max_num_seqs = max_num_seqs = limits.max_num_seqs
        graphdef, params = nnx.split(model)
        self.params_dtype = model.dtype
        self.quantization = config.load.quantization  # the weights' (re-applied to new weights)
        self.num_blocks = config.cache.num_blocks
        self.kv_dtype = config.cache.kv_dtype(self.params_dtype)
        self.step_programs = StepPrograms.for_engine(
            config, graphdef, parallel, self.kv_dtype, self.params_dtype, fused_options
        )
        self.packer = self.step_programs.packer
        self.pages = self.packer.pages
        self.layouts = self.packer.layouts
        self.input_batch = InputBatch(self.packer, max_num_seqs, eos_token_ids)
        self.draft = None  # the draft model's runner (speculative decoding with a draft model)
        # A model of shapes (`nnx.eval_shape`): the runner holds shapes, compiles, and runs nothing.
        self.abstract = any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params))
        if self.abstract:
            self.params = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                params,
                state_shardings(params, parallel),
            )
        else:
            self.params = place_params(params, parallel)  # no copy when the loader placed them already
        self._whole = parallel.sharding()
        lora = config.lora
        # LoRA adapters: the pool's (slots, rank, dtype), and where the engine reads an adapter's
        # weights from (`jaxpaged.engine.lora_registry`; set by the engine)
        self.lora_pool_shape = (lora.max_loras, lora.max_lora_rank, self.params_dtype) if lora.enable_lora else None
        self.lora_weights = None
        self._write_lora = None
        self.cache = self.zero_cache(config.cache.num_blocks)
        if kv_scales is not None and self.cache.kv.quant is not None:
            self.set_kv_scales(*kv_scales)
        self.kv_transfer = None  # the host tier's memory and copies
        if config.cache.num_host_blocks:
            k = self.cache.kv.k
            self.kv_transfer = KVTransfer(
                parallel,
                self.step_programs.cache_shardings,
                num_layers=self.pool_config.num_layers,
                num_host_blocks=config.cache.num_host_blocks,
                block_shape=k.shape[1:],
                dtype=k.dtype,
            )
        self.channel: StepChannel | None = None  # set on the leader of several processes
        self.compiled: dict[Program | SamplerProgram, object] = {}  # executables
        self.temp_bytes: dict[Program | SamplerProgram, int] = {}  # temporaries of each
        self._seed = None  # the compiled penalty-row seeding
        self.compile_report = []  # warm-up's `CompiledProgram`s: names and seconds
        self._mask_executor = None  # llguidance's threads that fill grammars' mask rows (made on first use)
        # Steps overlap (one in flight while the next is scheduled); a step that speculates waits
        # for the previous one (proposals follow the newest tokens) and is read at its end (a
        # draft model proposes for the next step from its tokens).
        self.async_scheduling = config.scheduling.async_scheduling
        # While grammars constrain running sequences, the step in flight is read before the next
        # is scheduled, so their forced runs are scheduled whole (overlapped, a run's first token
        # is still pending and the run costs two steps). Measured faster at every batch size
        # (benchmarks/results/README.md); False (overlap) is kept to measure that against.
        self.read_first_under_grammars = True
        self._in_flight: list[StepHandle] = []  # dispatched steps not handed to the engine yet
        self._read_at_once = False  # the step just executed must be read before the next

    # -- the parameters and the pool (the training loop's verbs, `engine/training_loop.py`) -----

    def update_params(self, new: dict[Key, jax.Array]) -> None:
        """Serves the arrays at `new`'s keys from the next step on (the others kept)."""
        self.params = replace_params(self.params, new)

    def set_params(self, params) -> None:
        """Serves a whole parameter state, placed by the sharding table."""
        self.params = place_params(params, self.parallel)

    def drop_params(self) -> None:
        """Lets go of the weights (their device memory is freed once nothing else holds them),
        keeping each array's shape, dtype and sharding."""
        self.params = sleep_mode.abstract(self.params)

    def sleep(self, level: int) -> "sleep_mode.Slept":
        """Gives the device memory back (sleep mode, `jaxpaged.worker.sleep`); returns what
        `wake_up` needs."""
        slept = sleep_mode.keep(self.params, self.cache, level)
        self.drop_params()
        self.cache = None
        return slept

    def wake_up(self, slept: "sleep_mode.Slept") -> None:
        """A fresh (zeroed) pool and, after level 1, the weights back where they were."""
        if slept.host_params is not None:
            self.params = sleep_mode.restore(slept.host_params, self.params)
        self.cache = self.zero_cache(self.num_blocks)
        if slept.kv_scales is not None:
            self.set_kv_scales(*slept.kv_scales)

    def load_lora(self, slot: int, weights) -> None:
        """Writes a LoRA adapter (`checkpoint.lora.LoraWeights`) into slot `slot` (1..max_loras)
        of the device's pool, in place (one compiled program for every slot and adapter)."""
        if self._write_lora is None:
            shardings = self.step_programs.cache_shardings.lora
            self._write_lora = jax.jit(write_slot, donate_argnums=0, out_shardings=shardings)
        slot = jax.device_put(np.int32(slot), self._whole)
        a = {k: jax.device_put(v.astype(self.params_dtype), self._whole) for k, v in weights.a.items()}
        b = {k: jax.device_put(v.astype(self.params_dtype), self._whole) for k, v in weights.b.items()}
        self.cache = dataclasses.replace(self.cache, lora=self._write_lora(self.cache.lora, slot, a, b))

    def mask_executor(self):
        """llguidance's thread pool for mask rows (made by the first masked step)."""
        if self._mask_executor is None:
            self._mask_executor = llguidance().LLExecutor(num_threads=2)
        return self._mask_executor

    def zero_cache(self, num_blocks: int) -> DeviceCache:
        """A cache of `num_blocks` pool blocks made where it lives: the pool split over kv heads (no
        device ever holds the whole pool), the penalty tables whole on every device (shapes only
        for a runner of shapes)."""
        kv_dtype, shardings = self.kv_dtype, self.step_programs.cache_shardings

        def make():
            return init_cache(
                self.pool_config,
                num_blocks=num_blocks,
                block_size=self.block_size,
                dtype=kv_dtype,
                max_num_seqs=self.max_num_seqs,
                platform=self.parallel.platform,
                lora=self.lora_pool_shape,
            )

        if self.abstract:
            return jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), jax.eval_shape(make), shardings
            )
        return jax.jit(make, out_shardings=shardings)()

    def set_kv_scales(self, k_scale: np.ndarray, v_scale: np.ndarray) -> None:
        """An fp8 pool's per-layer scales `[L]`, the same for every kv head of a layer (under
        pipeline parallelism each layer's go to its slot; an empty slot keeps 1)."""
        quant = self.cache.kv.quant
        sharding = self.step_programs.cache_shardings.kv.quant.k_scale
        shape = quant.k_scale.shape  # [pool layers, K]
        slots = [self.pipeline.virtual_layer(layer) for layer in range(self.config.num_layers)]

        def put(scales):
            per_slot = np.ones(shape[0], np.float32)
            per_slot[slots] = np.asarray(scales, np.float32)
            return jax.device_put(np.broadcast_to(per_slot[:, None], shape), sharding)

        quant = dataclasses.replace(quant, k_scale=put(k_scale), v_scale=put(v_scale))
        self.cache = dataclasses.replace(self.cache, kv=dataclasses.replace(self.cache.kv, quant=quant))

    def programs(self) -> list[Program | SamplerProgram]:
        """Every program this engine compiles (see `StepPrograms.all` and `samplers`)."""
        models = self.step_programs.all()
        return models + self.step_programs.samplers(models)

    def compile_program(self, program: Program | SamplerProgram):
        """Compiles (and keeps) one program; records its temporaries (XLA's memory analysis) in
        `temp_bytes`."""
        return self._keep(program, self.step_programs.lower(program, self.params, self.cache).compile())

    def _keep(self, program: Program | SamplerProgram, compiled):
        self.compiled[program] = compiled
        analysis = compiled.memory_analysis()
        self.temp_bytes[program] = int(getattr(analysis, "temp_size_in_bytes", 0) or 0)
        return compiled

    def warm_up(self, threads: int = 1) -> float:
        """Compiles every program (and the penalty-row seeding), `threads` at a time, logging each
        as it finishes; returns the seconds it took."""
        programs = self.programs()
        start = time.perf_counter()
        jobs = [
            (self.step_programs.describe(p), lambda p=p: self.step_programs.lower(p, self.params, self.cache))
            for p in programs
        ]
        jobs.append(("penalty-row seeding", lambda: self.step_programs.lower_seed(self.cache)))
        if self.kv_transfer is not None:
            jobs += self.kv_transfer.lower(self.cache)
        logger.info(  # one count, the one the progress lines below count to
            "compiling %d step programs (token buckets %s, fused decode steps %d) in %d thread(s)",
            len(jobs),
            sorted(self.layouts),
            self.num_decode_steps,
            threads,
        )
        results = self.compile_report = compile_all(jobs, threads, logger.info)
        for program, result in zip(programs, results):
            self._keep(program, result.executable)
        self._seed = results[len(programs)].executable
        if self.kv_transfer is not None:
            self.kv_transfer.set_compiled([r.executable for r in results[len(programs) + 1 :]])
        seconds = time.perf_counter() - start
        logger.info("compiled %d step programs in %.1f s", len(jobs), seconds)
        return seconds

    def seed_penalty_slot(self, slot: int, token_ids: list[int], prompt_len: int) -> None:
        """Resets penalty row `slot` and records tokens a sequence got from the prefix cache
        (the steps only see tokens they compute)."""
        size = self.pages * self.block_size
        ids = np.zeros(size, np.int32)
        ids[: len(token_ids)] = token_ids
        slots = np.full(size, self.max_num_seqs, np.int32)
        slots[: len(token_ids)] = slot
        is_output = np.arange(size) >= prompt_len
        if self.channel is not None:
            self.channel.send(SEED, (slot, prompt_len, len(token_ids)), ids)
        args = (ids, slots, is_output, np.array([slot], np.int32))
        seed = self._seed or self.step_programs.seed  # compiled by warm_up (else jit compiles it now)
        self.cache = seed(self.cache, *(jax.device_put(a, self._whole) for a in args))

    def move_kv(self, transfers: KVTransfers) -> None:
        """Carries out the host tier's copies (offloads, then loads) before the next step."""
        if transfers:
            self.cache = self.kv_transfer.run(self.cache, transfers)

    def read_before_schedule(self, propose: bool, needs_last_tokens: Callable[[], bool]) -> list[StepHandle]:
        """The steps in flight that the next schedule must see read, oldest first: all of them
        when it proposes (proposals follow the newest tokens) or when a running grammar needs its
        sequence's last token (`needs_last_tokens`, a scan of the running sequences, asked only
        then; with `read_first_under_grammars`, or always over several processes, whose step
        channel sends a step with its masks): its forced runs are then scheduled whole.
        Otherwise none: the next step overlaps them."""
        if not self._in_flight:
            return []
        if propose or ((self.channel is not None or self.read_first_under_grammars) and needs_last_tokens()):
            return self._take()
        return []

    def execute(self, output: SchedulerOutput) -> list[StepHandle]:
        """Carries out one scheduled step: the slots freed, the host tier's copies, the slots
        taken, then the step (or its fused steps) dispatched and its results' copy to the host
        started; the write-through copies after it. Returns without waiting for the device: the
        handles of the steps dispatched before it, oldest first, for the engine to read while
        this one runs. This step's handles stay in flight (`sample`)."""
        previous, self._in_flight = self._in_flight, []
        self.input_batch.release(output.released_seq_ids)
        if self.draft is not None:
            self.draft.release(output.released_seq_ids)
        handles = self._drain() if output.transfers else []  # (a pipeline's micro-batches leave first)
        self.move_kv(output.transfers)
        for slot, adapter in output.lora_loads:
            self.load_lora(slot, self.lora_weights(adapter))
        prepared = None
        if not output.is_empty:
            prepared = self.input_batch.prepare(output.step_inputs)
            for slot, tokens, prompt_len in prepared.seeds:
                self.seed_penalty_slot(slot, tokens, prompt_len)
        handles += self._dispatch_step(output, prepared)
        if output.stores:  # write-through of what the step computed, once its blocks are whole
            handles += self._drain()
            self.move_kv(output.stores)
        self._in_flight = handles
        self._read_at_once = not self.async_scheduling or bool(output.num_draft_tokens or any(output.drafting))
        return previous

    def sample(self) -> list[StepHandle]:
        """Dispatches the samplers of the step just executed that wait for their token masks
        (`dispatch_sampler`: the masks follow the tokens the engine read since `execute`);
        returns that step's handles when it must be read at once (no async scheduling, proposals
        checked, a draft model to propose from its tokens), else none (they stay in flight)."""
        for handle in self._in_flight:
            self.dispatch_sampler(handle)
        return self._take() if self._read_at_once else []

    def read_all(self) -> list[StepHandle]:
        """Runs what is dispatched to the end and hands over every step still to read, oldest
        first (the engine reads them while paused or asleep)."""
        handles, self._in_flight = self._in_flight + self._drain(), []
        return handles

    def _take(self) -> list[StepHandle]:
        handles, self._in_flight = self._in_flight, []
        return handles

    @property
    def busy(self) -> bool:
        """Whether dispatched work is still to be handed to the engine."""
        return bool(self._in_flight)

    @property
    def in_flight_seq_ids(self) -> frozenset[int]:
        """Sequences that the next schedule must pass over: those whose step is dispatched but
        not yet among the handles (none here: a step's handle comes with it; see
        `PipelinedRunner`)."""
        return frozenset()

    def _dispatch_step(self, output: SchedulerOutput, prepared) -> list[StepHandle]:
        """The stage a pipelined runner overrides: dispatches the step (`prepared`: its slots, or
        None when the schedule computes nothing) and returns the handles of the steps whose
        results are coming (here the step's own)."""
        if prepared is None:
            return []
        num_drafts = num_drafts_of(output)
        # Without other processes a masked step's sampler waits for `sample` (its masks follow
        # the previous step's tokens); their step channel sends a step whole, masks included.
        defer = prepared.options.mask and output.num_steps == 1 and self.channel is None
        program, layout, flat = self._pack(output.step_inputs, prepared, output.num_steps, num_drafts, defer)
        rows = layout.num_seqs * layout.rows_per_seq
        speculative = program.steps == 1 and layout.rows_per_seq > 1
        logprobs = prepared.options.logprobs if program.steps == 1 else program.options.logprobs
        handle = StepHandle(output, None, ResultLayout(rows, layout.num_seqs, logprobs, speculative))
        if defer:
            logits, sampler_input, handle.prompt_packed = self._run_model(program, flat[: layout.size])
            sampler = self.compiled[sampler_for(layout, prepared.options)]
            constrained = [i for i, s in enumerate(output.step_inputs) if s.constraint is not None]
            mask = self.packer.mask_of(layout, flat)
            handle.pending = PendingSample(sampler, logits, sampler_input, mask, constrained)
        else:
            handle.packed, handle.prompt_packed = self._run(program, prepared.options, flat)
            handle.packed.copy_to_host_async()
        if handle.prompt_packed is not None:
            handle.prompt_packed.copy_to_host_async()
        return [handle]

    def _drain(self) -> list[StepHandle]:
        """Runs what is dispatched to the end; returns the handles of steps still to come back
        (none here: each step's handle comes back with it; see `PipelinedRunner`)."""
        return []

    def dispatch_sampler(self, handle: StepHandle) -> None:
        """Fills a masked step's token masks from its sequences' constraints (as the previous
        step's tokens left them) and dispatches its sampler; nothing for other steps. A sequence
        that finished since it was scheduled keeps an all-ones row (its token is surplus)."""
        pending = handle.pending
        if pending is None:
            return
        handle.pending = None
        output = handle.output
        live = live_entries(output, pending.entries)
        num_drafts = num_drafts_of(output)
        r = handle.layout.rows // handle.layout.num_seqs
        fill_bitmask(self.mask_executor(), mask_rows(output.step_inputs, num_drafts, live, r), pending.mask)
        mask = jax.device_put(pending.mask, self._whole)
        handle.packed = self._run_sampler(pending.sampler, pending.logits, pending.sampler_input, mask)
        handle.packed.copy_to_host_async()

    def _pack(self, inputs: list[ScheduledSequence], prepared, steps: int, num_drafts: list[int], defer: bool):
        """The step's program, layout and packed buffer (sent to the other processes first); its
        masks are filled now unless `defer` (then `dispatch_sampler` fills them)."""
        t = self.packer.bucket_for(sum(len(s.token_ids) for s in inputs), len(inputs))
        prompt_logprobs = any(s.prompt_targets for s in inputs)  # the mixed variant (never fused)
        decode = all(len(s.token_ids) == 1 for s in inputs) and not prompt_logprobs
        options = self.step_programs.fused_options if steps > 1 else SamplerOptions()
        lora = self.step_programs.lora and any(s.lora_slot for s in inputs)  # else no adapter deltas
        program = Program(t, steps, decode, options, prompt_logprobs, lora)
        if program not in self.compiled and not prompt_logprobs:
            raise RuntimeError(f"no compiled program {program}: call warm_up() first")
        live = [s.live_steps for s in inputs] if steps > 1 else None
        masked = prepared.options.mask and steps == 1
        t, flat = self.packer.pack(
            inputs, prepared.rows, prepared.resets, num_drafts, decode=decode, live_steps=live, masked=masked
        )
        if masked and not defer:  # the constrained rows' masks (the others stay all ones)
            layout = self.step_programs.layout(program)
            entries = [i for i, s in enumerate(inputs) if s.constraint is not None]
            rows = mask_rows(inputs, num_drafts, entries, layout.rows_per_seq)
            fill_bitmask(self.mask_executor(), rows, self.packer.mask_of(layout, flat))
        if self.channel is not None:
            options = prepared.options if steps == 1 else program.options
            # bits 0-2: the sampler's
            bits = option_bits(options) | int(program.prompt_logprobs) << 3 | int(program.lora) << 4
            self.channel.send(EXECUTE, (program.tokens, program.steps, int(program.decode), bits), flat)
        return program, self.step_programs.layout(program), flat

    def follow_step(self, fields: tuple[int, ...], payload: np.ndarray) -> None:
        """A follower process runs the step the leader sent (`fields`: its step-channel header)."""
        self.run_packed(*self.program_from_fields(fields), payload)

    def run_packed(self, program: Program, options: SamplerOptions, flat: np.ndarray) -> jax.Array:
        """Runs a compiled program (and, for one step, the sampler with `options`) on a packed step
        buffer; returns the packed results (the followers of a multi-process engine get the same
        arguments from the leader). With `options.mask` the buffer's tail is the token mask, sent
        to the device as the sampler's own array."""
        return self._run(program, options, flat)[0]

    def _run(self, program: Program, options: SamplerOptions, flat: np.ndarray) -> tuple[jax.Array, jax.Array | None]:
        """`run_packed`, also returning the packed prompt logprobs of a `prompt_logprobs` program
        (None otherwise). That variant is compiled the first time a step needs it."""
        mask = None
        if options.mask:
            layout = self.step_programs.layout(program)
            mask, flat = jax.device_put(self.packer.mask_of(layout, flat), self._whole), flat[: layout.size]
        if program.steps > 1:
            self.cache, packed = self.compiled[program](self.params, self.cache, jax.device_put(flat, self._whole))
            return packed, None
        logits, sampler_input, prompt_packed = self._run_model(program, flat)
        sampler = self.compiled[sampler_for(self.step_programs.layout(program), options)]
        return self._run_sampler(sampler, logits, sampler_input, mask), prompt_packed

    def _run_model(self, program: Program, flat: np.ndarray):
        """Dispatches a single step's model program on its packed fields (no mask); returns its
        logits, `SamplerInput` and packed prompt logprobs (None unless `prompt_logprobs`). That
        variant is compiled the first time a step needs it."""
        flat = jax.device_put(flat, self._whole)
        prompt_packed = None
        if program.prompt_logprobs:
            self.cache, logits, sampler_input, prompt_packed = self.executable(program)(self.params, self.cache, flat)
        else:
            self.cache, logits, sampler_input = self.compiled[program](self.params, self.cache, flat)
        return logits, sampler_input, prompt_packed

    def executable(self, program: Program):
        """A model program's executable; a `prompt_logprobs` variant is compiled the first time
        a step needs it."""
        if program not in self.compiled:
            start = time.perf_counter()
            self.compile_program(program)
            logger.info(
                "compiled %s (first request with prompt_logprobs in this bucket) in %.1f s",
                self.step_programs.describe(program),
                time.perf_counter() - start,
            )
        return self.compiled[program]

    def _run_sampler(self, sampler, logits: jax.Array, sampler_input, mask: jax.Array | None) -> jax.Array:
        """Dispatches a sampler program (with `mask` as the token mask); returns its packed results."""
        if mask is not None:
            sampler_input = dataclasses.replace(sampler_input, token_mask=mask)
        last_tokens, packed = sampler(
            self.cache.prompt_mask, self.cache.output_counts, self.cache.last_tokens, logits, sampler_input
        )
        self.cache = dataclasses.replace(self.cache, last_tokens=last_tokens)
        return packed

    def fetch(self, handle: StepHandle) -> StepResult:
        """Waits for a step's results; returns them per scheduled entry, with a draft model's
        proposals for its `drafting` entries. A masked step's sampler is dispatched first if it
        still waits (`dispatch_sampler`)."""
        self.dispatch_sampler(handle)
        out = handle.output
        values = handle.layout.unpack(np.asarray(handle.packed))
        steps = out.num_steps
        if steps == 1:
            values = {k: v[None] for k, v in values.items()}
        r = handle.layout.rows // handle.layout.num_seqs
        token_ids = values["token_ids"]
        num_drafts = [len(d) for d in out.drafts] or [0] * out.num_seqs
        accepted = None
        tokens = []
        if handle.layout.speculative:
            accepted = values["num_accepted"][0, : out.num_seqs].tolist()
            for i, (a, samples) in enumerate(zip(accepted, out.samples)):
                tokens.append(token_ids[0, i * r : i * r + a + 1].tolist() if samples else [])
        else:
            for i, (inp, samples) in enumerate(zip(out.step_inputs, out.samples)):
                n = inp.live_steps if steps > 1 else 1
                tokens.append(token_ids[:n, i * r].tolist() if samples else [])
        result = StepResult(tokens, values, r, num_drafts, accepted, self._draft_proposals(out, tokens))
        if handle.prompt_packed is not None:
            result.prompt_logprobs = _prompt_logprobs_of(out.step_inputs, np.asarray(handle.prompt_packed))
        return result

    def _draft_proposals(self, output: SchedulerOutput, tokens: list[list[int]]) -> dict[int, list[int]]:
        """The draft model's proposals after a step's new `tokens`, for its `drafting` entries that
        sampled and go on (none without a draft model)."""
        if self.draft is None or not any(output.drafting):
            return {}
        entries = [
            i for i, d in enumerate(output.drafting) if d and tokens[i] and not output.scheduled[i][0].is_finished
        ]
        seqs = [output.scheduled[i][0] for i in entries]
        rows = [self.input_batch.row_of(seq.seq_id) for seq in seqs]
        return self.draft.propose(seqs, [tokens[i] for i in entries], rows)

    @staticmethod
    def program_from_fields(fields: tuple[int, ...]) -> tuple[Program, SamplerOptions]:
        """The program (and sampler options) the leader named in a step-channel header."""
        options = SamplerOptions(filter=bool(fields[3] & 1), logprobs=bool(fields[3] & 2), mask=bool(fields[3] & 4))
        steps = fields[1]
        fused = options if steps > 1 else SamplerOptions()
        return Program(fields[0], steps, bool(fields[2]), fused, bool(fields[3] & 8), bool(fields[3] & 16)), options


def num_drafts_of(output) -> list[int]:
    """How many proposals each entry of a scheduled step checks (zeros when none speculates)."""
    return [len(d) for d in output.drafts] or [0] * output.num_seqs


def live_entries(output: SchedulerOutput, entries: list[int]) -> list[int]:
    """Of a step's `entries`, those whose sequence has not finished since it was scheduled (a
    finished one's mask row stays all ones: its token is surplus)."""
    return [i for i in entries if not output.scheduled[i][0].is_finished]


def mask_rows(inputs: list[ScheduledSequence], num_drafts: list[int], entries: list[int], rows_per_seq: int):
    """`(constraint, first row, forced, proposals)` of constrained entries, for `fill_bitmask` (an
    entry's proposals are its last `num_drafts` tokens, its `num_forced` tokens before them)."""
    out = []
    for i in entries:
        tokens, d, f = inputs[i].token_ids, num_drafts[i], inputs[i].num_forced
        end = len(tokens) - d
        out.append((inputs[i].constraint, i * rows_per_seq, tokens[end - f : end], tokens[end:]))
    return out


def _prompt_logprobs_of(inputs: list[ScheduledSequence], packed: np.ndarray) -> dict[int, tuple]:
    """Each entry's rows of a step's packed prompt logprobs (see `StepResult.prompt_logprobs`)."""
    logprobs, ranks, top_ids, top_logprobs = unpack_prompt_logprobs(packed)
    out, start = {}, 0
    for i, seq in enumerate(inputs):
        if seq.prompt_targets:
            rows = slice(start, start + len(seq.prompt_targets))
            out[i] = (seq.num_computed + 1, logprobs[rows], ranks[rows], top_ids[rows], top_logprobs[rows])
        start += len(seq.token_ids)
    return out


def option_bits(options: SamplerOptions) -> int:
    """The sampler options as bits 0-2 of a step-channel header (`program_from_fields` reads them)."""
    return int(options.filter) | int(options.logprobs) << 1 | int(options.mask) << 2
