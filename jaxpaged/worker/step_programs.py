"""The engine's step programs: which exist for a packer's buckets, and how each is lowered.

Each step arrives as one flat int32 buffer packed by `StepPacker` (see step_packer.py for the
layout and buckets); a compiled step slices it back into a `StepInput` (`unpack`) and runs the
pure `functional.step` with the cache (KV pool + penalty tables) donated and rebound. A program
lowers from real arrays or from shapes alone (`jax.ShapeDtypeStruct`s with shardings), so
`jaxpaged bench startup` compiles an 8B engine's programs with nothing materialised.
"""

import concurrent.futures
import dataclasses
import threading
import time
import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config.engine_config import EngineConfig
from jaxpaged.functional import DeviceCache, StepInput, step
from jaxpaged.config.quantization import is_fp8
from jaxpaged.model import AttentionMetadata, KVPool, KVQuant
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.parallel.sharding import KV_SCALE_AXES
from jaxpaged.worker.sampler import SamplingTensors, update_penalty_tables
from jaxpaged.worker.step_packer import SAMPLING_FIELDS, Layout, StepPacker


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
        num_drafts=v["num_drafts"],
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


class StepPrograms:
    """Every step program of an engine, jitted with the cache donated and results whole on
    every device (every process can read them).

    Args:
      graphdef: the model's structure (`nnx.split`).
      packer: the step packer; its layouts are the token buckets.
      num_decode_steps: decode steps fused into one decode program (1: no fusing).
      cache_shardings: where the cache lives (`DeviceCache` of shardings).
      whole: the replicated sharding of the mesh.
    """

    def __init__(self, graphdef, packer: StepPacker, num_decode_steps: int, cache_shardings: DeviceCache, whole):
        self.graphdef = graphdef
        self.packer = packer
        self.num_decode_steps = num_decode_steps
        self.cache_shardings = cache_shardings
        self._step = jax.jit(_packed_step, static_argnums=(0, 1), donate_argnums=(3,),
                             out_shardings=(cache_shardings, whole))  # fmt: skip
        self._decode_steps = jax.jit(_packed_decode_steps, static_argnums=(0, 1, 2), donate_argnums=(4,),
                                     out_shardings=(cache_shardings, whole))  # fmt: skip
        self.seed = jax.jit(_seed_penalty_rows, donate_argnums=(0,), out_shardings=cache_shardings)

    @classmethod
    def for_engine(cls, config: EngineConfig, graphdef, parallel: TensorParallel, kv_dtype: str) -> "StepPrograms":
        """The programs of an engine: its packer (buckets from the engine's limits), the cache on
        the mesh (pool split by the sharding table, penalty tables whole) of a `kv_dtype` pool."""
        args = config.args
        spec = args.speculative_config
        packer = StepPacker(block_size=args.block_size, max_model_len=config.max_model_len, max_num_seqs=args.max_num_seqs,
                            max_num_batched_tokens=args.max_num_batched_tokens, vocab_size=config.model.vocab_size,
                            rows_per_seq=1 + (spec.num_speculative_tokens if spec else 0))  # fmt: skip
        whole, pool = parallel.sharding(), parallel.pool_sharding
        scales = parallel.logical_sharding(KV_SCALE_AXES)
        quant = KVQuant(k_scale=scales, v_scale=scales, dtype=kv_dtype) if is_fp8(kv_dtype) else None
        shardings = DeviceCache(kv=KVPool(k=pool, v=pool, num_layers=config.model.num_layers, quant=quant),
                                prompt_mask=whole, output_counts=whole)  # fmt: skip
        return cls(graphdef, packer, args.num_scheduler_steps, shardings, whole)

    def all(self) -> list[Program]:
        """Every program: a mixed step (ragged attention) for each token bucket, and decode steps
        (the decode kernel, `num_decode_steps` of them fused) for each bucket a decode-only batch
        uses (one token per sequence)."""
        mixed = [Program(t, 1, False) for t in self.packer.layouts]
        max_num_seqs = self.packer.max_num_seqs
        decode_buckets = sorted({self.packer.bucket_for(n, n) for n in range(1, max_num_seqs + 1)})
        return mixed + [Program(t, self.num_decode_steps, True) for t in decode_buckets]

    def describe(self, program: Program) -> str:
        """E.g. "mixed step, 64 tokens x 1 step(s), 8 seqs"."""
        return f"{program.describe()}, {self.packer.layouts[program.tokens].num_seqs} seqs"

    def lower(self, program: Program, params, cache: DeviceCache) -> jax.stages.Lowered:
        """Lowers one program for these parameters and this cache (arrays or shapes)."""
        layout = (self.packer.decode_layouts if program.decode else self.packer.layouts)[program.tokens]
        flat = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        if program.decode:
            return self._decode_steps.lower(layout, program.steps, self.graphdef, params, cache, flat)
        return self._step.lower(layout, self.graphdef, params, cache, flat)

    def lower_seed(self, cache: DeviceCache) -> jax.stages.Lowered:
        """Lowers the program that seeds a penalty-table row (see `ModelRunner.seed_penalty_slot`)."""
        size = self.packer.pages * self.packer.block_size
        ints = jax.ShapeDtypeStruct((size,), jnp.int32)
        return self.seed.lower(cache, ints, ints, jax.ShapeDtypeStruct((size,), jnp.bool_),
                               jax.ShapeDtypeStruct((1,), jnp.int32))  # fmt: skip


@dataclasses.dataclass
class CompiledProgram:
    """One program compiled by `compile_all`, with the seconds its lowering and compiling took."""

    name: str
    executable: jax.stages.Compiled
    lower_s: float
    compile_s: float


def compile_all(jobs: list[tuple[str, Callable[[], jax.stages.Lowered]]], threads: int,
                log: Callable[[str], None] = lambda line: None) -> list[CompiledProgram]:  # fmt: skip
    """Compiles `(name, lower)` jobs: this thread lowers them one after another (tracing holds
    Python's lock) while `threads` threads compile the lowered ones (XLA compiles without it).

    Args:
      jobs: each program's name and the function that lowers it.
      threads: compiling threads (1: one program after another).
      log: gets a progress line as each program finishes ("compiled step program i/n: ...").

    Returns:
      The compiled programs, in the order of `jobs`.
    """

    def compile_one(name: str, lowered: jax.stages.Lowered, lower_s: float) -> CompiledProgram:
        start = time.perf_counter()
        executable = lowered.compile()
        result = CompiledProgram(name, executable, lower_s, time.perf_counter() - start)
        with lock:
            done.append(name)
            log(f"compiled step program {len(done)}/{len(jobs)}: {name} in {result.compile_s:.1f} s")
        return result

    lock, done = threading.Lock(), []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        futures = []
        for name, lower in jobs:
            start = time.perf_counter()
            lowered = lower()
            futures.append(pool.submit(compile_one, name, lowered, time.perf_counter() - start))
        return [f.result() for f in futures]
