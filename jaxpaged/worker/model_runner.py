"""The device side of the engine: parameters, the cache, bucketed compiled steps, one transfer.

Each step arrives as one flat int32 buffer packed by `StepPacker` (see step_packer.py for the
layout and buckets); the compiled step slices it back into a `StepInput` (`unpack`) and runs
the pure `functional.step` with the cache (KV pool + penalty tables) donated and rebound.
Every bucket is compiled by `warm_up`, so nothing compiles while serving.
"""

import dataclasses
import logging
import time
import typing

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.config.engine_config import EngineConfig
from jaxpaged.core.step_inputs import ScheduledSequence
from jaxpaged.functional import DeviceCache, StepInput, init_cache, step
from jaxpaged.model import AttentionMetadata, KVPool, Llama
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.parallel.multihost import EXECUTE, SEED, StepChannel
from jaxpaged.worker.sampler import SampleResult, SamplingTensors, update_penalty_tables
from jaxpaged.worker.step_packer import SAMPLING_FIELDS, Layout, SequenceRow, StepPacker

logger = logging.getLogger("jaxpaged")


def unpack(layout: Layout, flat: jax.Array) -> StepInput:
    """Device side of the single transfer: the flat int32 buffer back into a `StepInput`."""
    v = layout.views(flat)
    rows = {name: v["sampling"][i] for i, (name, _) in enumerate(SAMPLING_FIELDS)}
    for name, dtype in SAMPLING_FIELDS:
        if dtype == np.float32:
            rows[name] = jax.lax.bitcast_convert_type(rows[name], jnp.float32)
    return StepInput(
        token_ids=v["token_ids"],
        metadata=AttentionMetadata(
            positions=v["positions"], slot_mapping=v["slot_mapping"], cu_q_lens=v["cu_q_lens"],
            kv_lens=v["kv_lens"], block_tables=v["block_tables"], num_seqs=v["num_seqs"],
        ),  # fmt: skip
        logits_indices=v["logits_indices"],
        sampling=SamplingTensors(**rows),
        token_slot=v["token_slot"],
        token_is_output=v["token_is_output"] != 0,
        reset_slots=v["reset_slots"],
        want_logprobs=v["want_logprobs"] != 0,
        banned_ids=v["banned_ids"],
    )


def _packed_step(layout: Layout, graphdef, params, cache: DeviceCache, flat: jax.Array):
    return step(graphdef, params, cache, unpack(layout, flat))


def _packed_decode_steps(layout: Layout, num_steps: int, graphdef, params, cache: DeviceCache, flat: jax.Array):
    """`num_steps` decode steps in one program: each feeds back the tokens the previous sampled.

    Only for decode-only batches (token i belongs to sequence i) whose sequences all have
    blocks and budget for `num_steps` more tokens. Results are stacked `[num_steps, S, ...]`
    (unstacked for one step).
    """
    inp = unpack(layout, flat)
    inp = dataclasses.replace(inp, metadata=dataclasses.replace(inp.metadata, decode_only=True))
    if num_steps == 1:
        return step(graphdef, params, cache, inp)
    meta = inp.metadata
    num_seqs, num_tokens = layout.num_seqs, layout.num_tokens
    bs = cache.kv.block_size
    live_token = jnp.arange(num_tokens) < meta.num_seqs
    live_seq = jnp.arange(num_seqs) < meta.num_seqs
    no_reset = jnp.full_like(inp.reset_slots, cache.prompt_mask.shape[0])  # out of range: nothing reset

    def body(carry, _):
        cache, inp = carry
        cache, result = step(graphdef, params, cache, inp)
        m = inp.metadata
        positions = jnp.where(live_token, m.positions + 1, 0)
        seq_of_token = jnp.minimum(jnp.arange(num_tokens), num_seqs - 1)
        blocks = m.block_tables[seq_of_token, positions // bs]
        next_tokens = jnp.zeros(num_tokens, jnp.int32).at[:num_seqs].set(result.token_ids)
        next_inp = dataclasses.replace(
            inp,
            token_ids=jnp.where(live_token, next_tokens, 0),
            metadata=dataclasses.replace(
                m,
                positions=positions,
                slot_mapping=jnp.where(live_token, blocks * bs + positions % bs, 0),
                kv_lens=jnp.where(live_seq, m.kv_lens + 1, 0),
            ),
            sampling=dataclasses.replace(inp.sampling, position=inp.sampling.position + 1),
            token_is_output=live_token,
            reset_slots=no_reset,
        )
        return (cache, next_inp), result

    (cache, _), results = jax.lax.scan(body, (cache, inp), None, length=num_steps)
    return cache, results


def _seed_penalty_rows(cache: DeviceCache, token_ids, token_slot, token_is_output, reset_slots) -> DeviceCache:
    prompt_mask, output_counts = update_penalty_tables(
        cache.prompt_mask, cache.output_counts, token_ids, token_slot, token_is_output, reset_slots
    )
    return DeviceCache(kv=cache.kv, prompt_mask=prompt_mask, output_counts=output_counts)


class Program(typing.NamedTuple):
    """One compiled step program.

    Attributes:
      tokens: the token bucket (its layout fixes the sequence bucket too).
      steps: steps run in one call (fused decode steps feed back what they sample).
      decode: every sequence has one token: the decode kernel, no ragged attention. A mixed
        program runs the ragged kernel, which also serves decode-only batches.
    """

    tokens: int
    steps: int
    decode: bool

    def describe(self) -> str:
        return f"{'decode' if self.decode else 'mixed'} step, {self.tokens} tokens x {self.steps} step(s)"


class ModelRunner:
    """Runs engine steps on the device.

    Args:
      model: the NNX model (split once; its params are placed by the sharding table).
      parallel: the mesh and sharding table (one device: `TensorParallel.create(config)`).
      config: the engine's configuration, planned: the pool's `num_blocks` (the null block
        included), the scheduler's limits, `num_scheduler_steps` decode steps fused into one
        program when a batch is all decodes (1: no fusing). The pool is stored in
        `kv_storage_dtype` of the model's dtype.
    """

    def __init__(self, model: Llama, *, parallel: TensorParallel, config: EngineConfig):
        args = config.args
        self.config = model.config
        self.num_decode_steps = args.num_scheduler_steps
        self.parallel = parallel
        self.block_size = block_size = args.block_size
        self.max_num_seqs = max_num_seqs = args.max_num_seqs
        max_num_batched_tokens, max_model_len = args.max_num_batched_tokens, config.max_model_len
        num_blocks, kv_dtype = config.num_blocks, model.embed[...].dtype
        self.packer = StepPacker(block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens, vocab_size=self.config.vocab_size)  # fmt: skip
        self.pages = self.packer.pages
        self.layouts = self.packer.layouts
        graphdef, params = nnx.split(model)
        self.graphdef = graphdef
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._slot_of: dict[int, int] = {}  # seq_id -> its penalty-table row and block-table row
        self.params = parallel.place_state(params)  # no copy when the loader placed them already
        self._whole = parallel.sharding()
        whole, pool, layers = self._whole, parallel.pool_sharding, self.config.num_layers
        cache_shardings = DeviceCache(kv=KVPool(k=(pool,) * layers, v=(pool,) * layers), prompt_mask=whole,
                                      output_counts=whole)  # fmt: skip
        self.cache = self._zero_cache(num_blocks, kv_dtype, cache_shardings)
        # Results are whole on every device (every process can read them).
        self._step = jax.jit(_packed_step, static_argnums=(0, 1), donate_argnums=(3,),
                             out_shardings=(cache_shardings, whole))  # fmt: skip
        self._decode_steps = jax.jit(_packed_decode_steps, static_argnums=(0, 1, 2), donate_argnums=(4,),
                                     out_shardings=(cache_shardings, whole))  # fmt: skip
        self._seed = jax.jit(_seed_penalty_rows, donate_argnums=(0,), out_shardings=cache_shardings)
        self.channel: StepChannel | None = None  # set on the leader of several processes
        self.compiled: dict[Program, object] = {}  # executables
        self.temp_bytes: dict[Program, int] = {}  # temporaries of each

    def _zero_cache(self, num_blocks: int, kv_dtype, shardings: DeviceCache) -> DeviceCache:
        """The cache made where it lives: the pool split over kv heads (no device ever holds the
        whole pool), the penalty tables whole on every device."""
        make = lambda: init_cache(self.config, num_blocks=num_blocks, block_size=self.block_size, dtype=kv_dtype,  # noqa: E731
                                  max_num_seqs=self.max_num_seqs, platform=self.parallel.platform)  # fmt: skip
        return jax.jit(make, out_shardings=shardings)()

    def programs(self) -> list[Program]:
        """Every program: a mixed step (ragged attention) for each token bucket, and decode steps
        (the decode kernel, `num_decode_steps` of them fused) for each bucket a decode-only batch
        uses (one token per sequence)."""
        mixed = [Program(t, 1, False) for t in self.layouts]
        decode_buckets = sorted({self.packer.bucket_for(n, n) for n in range(1, self.max_num_seqs + 1)})
        return mixed + [Program(t, self.num_decode_steps, True) for t in decode_buckets]

    def compile_program(self, program: Program):
        """Compiles (and keeps) one program; records its temporaries (XLA's memory analysis) in
        `temp_bytes`."""
        layout = self.layouts[program.tokens]
        flat = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        if program.decode:
            lowered = self._decode_steps.lower(layout, program.steps, self.graphdef, self.params, self.cache, flat)
        else:
            lowered = self._step.lower(layout, self.graphdef, self.params, self.cache, flat)
        compiled = self.compiled[program] = lowered.compile()
        analysis = compiled.memory_analysis()
        self.temp_bytes[program] = int(getattr(analysis, "temp_size_in_bytes", 0) or 0)
        return compiled

    def warm_up(self) -> float:
        """Compiles every program, logging each as it finishes; returns the seconds it took."""
        programs = self.programs()
        logger.info("compiling %d step programs (token buckets %s, fused decode steps %d)", len(programs),
                    sorted(self.layouts), self.num_decode_steps)  # fmt: skip
        start = time.perf_counter()
        for i, program in enumerate(programs, 1):
            began = time.perf_counter()
            self.compile_program(program)
            logger.info("compiled step program %d/%d: %s, %d seqs in %.1f s", i, len(programs), program.describe(),
                        self.layouts[program.tokens].num_seqs, time.perf_counter() - began)  # fmt: skip
        self.seed_penalty_slot(0, [], 0)  # compiles the seeding step too
        seconds = time.perf_counter() - start
        logger.info("compiled %d step programs in %.1f s", len(self.compiled), seconds)
        return seconds

    def fusable(self, num_seqs: int) -> bool:
        """Whether a decode-only batch of `num_seqs` sequences has a fused-steps program."""
        t = self.packer.bucket_for(num_seqs, num_seqs)
        return self.num_decode_steps > 1 and Program(t, self.num_decode_steps, True) in self.compiled

    def acquire_slot(self, seq_id: int) -> tuple[int, bool]:
        """The penalty-table (and block-table) row of a running sequence: `(slot, new)`, a free
        one when it has none (new: the caller resets or seeds it)."""
        slot = self._slot_of.get(seq_id)
        if slot is not None:
            return slot, False
        slot = self._slot_of[seq_id] = self._free_slots.pop()
        return slot, True

    def release_slot(self, seq_id: int) -> None:
        """Gives a sequence's row back (finished, aborted or preempted); no-op if it has none."""
        slot = self._slot_of.pop(seq_id, None)
        if slot is not None:
            self.packer.release(slot)
            self._free_slots.append(slot)

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
        self.cache = self._seed(self.cache, *(jax.device_put(a, self._whole) for a in args))

    def execute(self, inputs: list[ScheduledSequence], rows: list[SequenceRow], resets: list[int],
                steps: int = 1) -> SampleResult:  # fmt: skip
        """Packs, transfers and runs one step (or `steps` fused decode steps); returns the (not
        yet fetched) device result, stacked `[steps, ...]` when steps > 1."""
        t, flat = self.packer.pack(inputs, rows, resets)
        # A decode batch takes the decode program when there is one of `steps` steps (with fused
        # decoding there is none of 1 step: a single decode step runs as a mixed one).
        program = Program(t, steps, True)
        if program not in self.compiled or any(len(s.token_ids) != 1 for s in inputs):
            program = Program(t, steps, False)
        if program not in self.compiled:
            raise RuntimeError(f"no compiled program {program}: call warm_up() first")
        if self.channel is not None:
            self.channel.send(EXECUTE, (program.tokens, program.steps, int(program.decode)), flat)
        return self.run_packed(program, flat)

    def run_packed(self, program: Program, flat: np.ndarray) -> SampleResult:
        """Runs a compiled program on a packed step buffer (the followers of a multi-process
        engine get both from the leader)."""
        self.cache, result = self.compiled[program](self.params, self.cache, jax.device_put(flat, self._whole))
        return result

    @staticmethod
    def program_from_fields(fields: tuple[int, ...]) -> Program:
        """The program the leader named in a step-channel header."""
        return Program(fields[0], fields[1], bool(fields[2]))
