"""The engine's step programs: which exist for a packer's buckets, and how each is lowered.

Each step arrives as one flat int32 buffer packed by `StepPacker` (see step_packer.py for the
layout and buckets); a compiled program slices it back into a `StepInput` (`unpack`). A step
is two programs run back to back on the device, with no host work between them:

- the model program of its token bucket (`functional.forward`: K/V written, penalty tables
  updated, logits at the sampling rows out), the cache donated;
- the sampler program of its row count and `SamplerOptions` (`functional.sample_tokens`),
  `last_tokens` donated; its results come back as one int32 vector (`sampler.pack_result`).
  A step with constrained rows (`SamplerOptions.mask`) packs its token mask after the step's
  fields (`StepPacker.pack(masked=True)`); the mask reaches the sampler as its own array, so the
  model programs are the same with or without one (not one more model program per bucket).

Splitting them keeps the (expensive) model programs independent of which sampler paths a batch
needs, with no `lax.cond` anywhere: on a GPU a conditional waits for its predicate on the host.
Fused decode steps (`steps` > 1) are one program: each step feeds back what the previous
sampled, with the sampler inside the loop (plain options: batches that filter or want top
logprobs do not fuse). A program lowers from real arrays or from shapes alone
(`jax.ShapeDtypeStruct`s with shardings), so `jaxpaged bench startup` compiles an 8B engine's
programs with nothing materialised.

Under pipeline parallelism every 1-step model program is a pipeline tick instead
(`_tick_program`): it takes the carry of the micro-batches in flight (`CarryShape`) and the
leaving micro-batch's packed step besides the entering one's, and gives the leaving one's logits.
"""

import concurrent.futures
import dataclasses
import functools
import threading
import time
import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config.lora import lora_targets
from jaxpaged.config.quantization import is_fp8
from jaxpaged.engine_config import EngineConfig
from jaxpaged.functional import (
    DeviceCache,
    SamplerInput,
    StepInput,
    forward,
    forward_prompt_logprobs,
    forward_tick,
    sample_tokens,
    sampler_input,
    step,
)
from jaxpaged.model import AttentionMetadata, KVPool, KVQuant
from jaxpaged.model.lora import LoraPool
from jaxpaged.model.pipeline_carry import PipelineCarry, empty_carry
from jaxpaged.model.sampler import (
    ENGINE_SAMPLER_OPTIONS,
    MAX_LOGPROBS,
    SamplerOptions,
    SamplingTensors,
    pack_result,
    update_penalty_tables,
)
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.parallel.sharding import KV_SCALE_AXES, STAGES
from jaxpaged.worker.step_fields import MAX_BANNED, MAX_LOGIT_BIAS, SAMPLING_FIELDS, STEP_FIELDS
from jaxpaged.worker.step_packer import Layout, StepPacker, mask_words


def unpack(layout: Layout, flat: jax.Array, lora: bool = False) -> StepInput:
    """Device side of the single transfer: the flat int32 buffer back into a `StepInput`, each
    field as `step_fields.STEP_FIELDS` declares it. Without `lora` the tokens' adapter slots are
    left out (`lora_slots` None): a step with no adapter computes no adapter delta at all."""
    v = layout.views(flat)
    parts = {"step": {}, "metadata": {}}
    for field in STEP_FIELDS:
        if field.target in parts and (layout.rows_per_seq > 1 or not field.speculative):
            parts[field.target][field.name] = _device_value(field.kind, v[field.name])
    if not lora:
        parts["step"]["lora_slots"] = None
    return StepInput(metadata=AttentionMetadata(**parts["metadata"]), **parts["step"])


def _device_value(kind: str, words: jax.Array):
    """A field's int32 words as its device value (`StepField.kind`)."""
    if kind == "bool":
        return words != 0
    if kind == "float32":
        return jax.lax.bitcast_convert_type(words, jnp.float32)
    if kind == "sampling":
        rows = {name: words[i] for i, (name, _) in enumerate(SAMPLING_FIELDS)}
        floats = {name for name, dtype in SAMPLING_FIELDS if dtype == np.float32}
        return SamplingTensors(**{k: _device_value("float32", x) if k in floats else x for k, x in rows.items()})
    return words


def _model_program(layout: Layout, decode: bool, lora: bool, graphdef, params, cache: DeviceCache, flat: jax.Array):
    """One step's model: the cache, the logits and the sampler's inputs (`decode`: the decode
    kernel, every sequence has one token; `lora`: some token has a LoRA adapter)."""
    inp = unpack(layout, flat, lora)
    if decode:
        inp = dataclasses.replace(inp, metadata=dataclasses.replace(inp.metadata, decode_only=True))
    cache, logits = forward(graphdef, params, cache, inp)
    return cache, logits, sampler_input(inp)


def _prompt_logprobs_program(layout: Layout, lora: bool, graphdef, params, cache: DeviceCache, flat: jax.Array):
    """A mixed step that also computes prompt logprobs at every token (the variant of a step
    with a request that asks for them: `Program.prompt_logprobs`)."""
    inp = unpack(layout, flat, lora)
    cache, logits, prompt = forward_prompt_logprobs(graphdef, params, cache, inp)
    return cache, logits, sampler_input(inp), prompt


def _tick_program(
    layout: Layout,
    decode: bool,
    with_prompt_logprobs: bool,
    carry_shape: "CarryShape",
    graphdef,
    params,
    cache: DeviceCache,
    carry: PipelineCarry,
    flat: jax.Array,
    leaving_flat: jax.Array,
):
    """One pipeline tick (pipeline parallelism): the micro-batch packed in `flat` enters, the one
    packed in `leaving_flat` (P - 1 ticks ago) leaves with its logits and the sampler's inputs
    (`functional.forward_tick`). Both are packed in `layout`, the carry's."""
    inp, leaving = unpack(layout, flat), unpack(layout, leaving_flat)
    if decode:
        inp = dataclasses.replace(inp, metadata=dataclasses.replace(inp.metadata, decode_only=True))
    cache, carry, logits, prompt = forward_tick(graphdef, params, cache, carry, inp, leaving, with_prompt_logprobs)
    carry = jax.lax.with_sharding_constraint(carry, carry_shape.shardings(layout, decode))  # as it came in
    out = (cache, carry, logits, sampler_input(leaving))
    return (*out, prompt) if with_prompt_logprobs else out


def _sampler_program(options: SamplerOptions, prompt_mask, output_counts, last_tokens, logits, inp: SamplerInput):
    last_tokens, result = sample_tokens(prompt_mask, output_counts, last_tokens, logits, inp, options)
    return last_tokens, pack_result(result)


def _fused_decode_steps(
    layout: Layout,
    num_steps: int,
    options: SamplerOptions,
    lora: bool,
    graphdef,
    params,
    cache: DeviceCache,
    flat: jax.Array,
):
    """`num_steps` decode steps in one program: each feeds back the tokens the previous sampled.

    Only for decode-only batches (token i belongs to sequence i) whose sequences have blocks
    for their `live_steps`: a sequence's steps past those (it reached max_tokens or
    max_model_len inside the window) write into the null block and attend over its own tokens
    only; the host drops what they sample. Results are packed per step, stacked `[num_steps, N]`.
    """
    inp = unpack(layout, flat, lora)
    inp = dataclasses.replace(inp, metadata=dataclasses.replace(inp.metadata, decode_only=True))
    num_seqs, num_tokens = layout.num_seqs, layout.num_tokens
    bs = cache.kv.block_size
    live_steps = layout.views(flat)["live_steps"]
    seq_of_token = jnp.minimum(jnp.arange(num_tokens), num_seqs - 1)
    real_token = jnp.arange(num_tokens) < inp.metadata.num_seqs
    no_reset = jnp.full_like(inp.reset_slots, cache.prompt_mask.shape[0])  # out of range: nothing reset

    def body(carry, j):
        cache, inp = carry
        cache, result = step(graphdef, params, cache, inp, options)
        m = inp.metadata
        live_seq = (j + 1 < live_steps) & (jnp.arange(num_seqs) < m.num_seqs)  # the next step is its own
        live_token = real_token & live_seq[seq_of_token]
        positions = jnp.where(live_token, m.positions + 1, m.positions)
        blocks = m.block_tables[seq_of_token, positions // bs]
        next_tokens = jnp.zeros(num_tokens, jnp.int32).at[:num_seqs].set(result.token_ids)
        next_inp = dataclasses.replace(
            inp,
            token_ids=jnp.where(real_token, next_tokens, 0),
            metadata=dataclasses.replace(
                m,
                positions=positions,
                slot_mapping=jnp.where(live_token, blocks * bs + positions % bs, 0),  # else the null block
                kv_lens=jnp.where(live_seq, m.kv_lens + 1, m.kv_lens),
            ),
            sampling=dataclasses.replace(inp.sampling, position=inp.sampling.position + 1),
            token_is_output=live_token,
            from_last=jnp.zeros_like(inp.from_last),  # the tokens are the ones just sampled
            reset_slots=no_reset,
        )
        return (cache, next_inp), pack_result(result)

    (cache, _), results = jax.lax.scan(body, (cache, inp), jnp.arange(num_steps))
    return cache, results


def _seed_penalty_rows(cache: DeviceCache, token_ids, token_slot, token_is_output, reset_slots) -> DeviceCache:
    prompt_mask, output_counts = update_penalty_tables(
        cache.prompt_mask, cache.output_counts, token_ids, token_slot, token_is_output, reset_slots
    )
    return dataclasses.replace(cache, prompt_mask=prompt_mask, output_counts=output_counts)


class Program(typing.NamedTuple):
    """One compiled step program.

    Attributes:
      tokens: the token bucket (its layout fixes the sequence bucket too).
      steps: steps run in one call (fused decode steps feed back what they sample, with the
        sampler inside); 1: the model alone, a sampler program follows it.
      decode: every sequence has one token: the decode kernel, no ragged attention. A mixed
        program runs the ragged kernel, which also serves decode-only batches.
      options: the sampler paths of fused steps (1-step programs have their own samplers).
      prompt_logprobs: a mixed step that also returns every token's prompt logprobs
        (compiled on first use, not at warm-up: see `ModelRunner.run_packed`).
      lora: some token of the step has a LoRA adapter: the variant that computes the adapters'
        deltas (an engine with LoRA compiles both: a step without adapters pays nothing).
    """

    tokens: int
    steps: int
    decode: bool
    options: SamplerOptions = SamplerOptions()
    prompt_logprobs: bool = False
    lora: bool = False

    def describe(self) -> str:
        kind = "decode" if self.decode else "mixed + prompt logprobs" if self.prompt_logprobs else "mixed"
        sampler = f", sampler {self.options.describe()}" if self.steps > 1 else ""
        lora = ", LoRA" if self.lora else ""
        return f"{kind}{lora} step, {self.tokens} tokens x {self.steps} step(s){sampler}"


class SamplerProgram(typing.NamedTuple):
    """One compiled sampler: `num_seqs` sequences of `rows_per_seq` rows, with `options`."""

    num_seqs: int
    rows_per_seq: int
    options: SamplerOptions

    def describe(self) -> str:
        return f"sampler {self.options.describe()}, {self.num_seqs} seqs x {self.rows_per_seq} row(s)"


def sampler_for(layout: Layout, options: SamplerOptions) -> SamplerProgram:
    return SamplerProgram(layout.num_seqs, layout.rows_per_seq, options)


@dataclasses.dataclass(frozen=True)
class ResultLayout:
    """Where each result sits in a packed result vector (see `sampler.pack_result`)."""

    rows: int
    num_seqs: int
    logprobs: bool
    speculative: bool

    def unpack(self, packed: np.ndarray) -> dict[str, np.ndarray]:
        """`packed` `[..., N]` into named arrays `[..., rows(, L)]` (and `num_accepted [..., S]`)."""
        r, lead = self.rows, packed.shape[:-1]
        top = MAX_LOGPROBS if self.logprobs else 0
        sizes = [
            ("token_ids", r, ()),
            ("logprobs", r, ()),
            ("ranks", r, ()),
            ("top_ids", r * top, (r, top)),
            ("top_logprobs", r * top, (r, top)),
        ]
        if self.speculative:
            sizes.append(("num_accepted", self.num_seqs, ()))
        out, start = {}, 0
        for name, n, shape in sizes:
            value = packed[..., start : start + n].reshape(*lead, *(shape or (n,)))
            if name in ("logprobs", "top_logprobs"):
                value = value.view(np.float32)
            out[name] = value
            start += n
        return out


@dataclasses.dataclass(frozen=True)
class CarryShape:
    """The carry of a pipelined engine's step programs (pipeline parallelism): the micro-batches
    in flight between ticks (`PipelineCarry`), one shape per program's layout.

    Attributes:
      stages: P.
      hidden_size: D.
      dtype: the activations'.
      staged: where its activations `[P, Tm, D]` lie: split over the stages (each stage's row on
        its devices; the shift to the next stage is one collective permute).
      whole: where its metadata and busy flags lie: whole on every device (each stage reads its
        row; shifting them moves nothing between devices).
    """

    stages: int
    hidden_size: int
    dtype: typing.Any
    staged: typing.Any
    whole: typing.Any

    def shardings(self, layout: Layout, decode: bool) -> PipelineCarry:
        carry = jax.eval_shape(lambda: self._empty(layout, decode))
        whole = jax.tree.map(lambda _: self.whole, carry)
        return dataclasses.replace(whole, hidden=self.staged)

    def shapes(self, layout: Layout, decode: bool) -> PipelineCarry:
        """The carry of `layout`'s micro-batches as shapes with their shardings."""
        carry = jax.eval_shape(lambda: self._empty(layout, decode))
        return jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), carry, self.shardings(layout, decode)
        )

    def empty(self, layout: Layout, decode: bool) -> PipelineCarry:
        """A carry with nothing in flight for `layout`'s micro-batches, made where it lives (one
        compiled program per shape, made the first time)."""
        return _empty_carry_program(self, layout, decode)()

    def _empty(self, layout: Layout, decode: bool) -> PipelineCarry:
        meta = unpack(layout, jnp.zeros((layout.size,), jnp.int32)).metadata
        meta = dataclasses.replace(meta, decode_only=decode)
        return empty_carry(self.stages, self.hidden_size, self.dtype, meta)


@functools.cache
def _empty_carry_program(shape: CarryShape, layout: Layout, decode: bool):
    return jax.jit(functools.partial(shape._empty, layout, decode), out_shardings=shape.shardings(layout, decode))


class StepPrograms:
    """Every step program of an engine, jitted with the cache donated and results whole on
    every device (every process can read them).

    Args:
      graphdef: the model's structure (`nnx.split`).
      packer: the step packer; its layouts are the token buckets.
      num_decode_steps: decode steps fused into one decode program (1: no fusing).
      cache_shardings: where the cache lives (`DeviceCache` of shardings).
      whole: the replicated sharding of the mesh.
      fused_options: the sampler paths of the fused decode programs.
      carry: with pipeline parallelism, the carry of the micro-batches in flight: every 1-step
        model program is then one pipeline tick (`_tick_program`), called with the carry and
        the leaving micro-batch's packed step besides the entering one's.
    """

    def __init__(
        self,
        graphdef,
        packer: StepPacker,
        num_decode_steps: int,
        cache_shardings: DeviceCache,
        whole,
        fused_options: SamplerOptions = SamplerOptions(),
        carry: CarryShape | None = None,
    ):
        self.graphdef = graphdef
        self.carry = carry
        self.packer = packer
        self.num_decode_steps = num_decode_steps
        self.cache_shardings = cache_shardings
        self.fused_options = fused_options
        self.whole = whole
        self.lora = cache_shardings.lora is not None  # LoRA: every program also in its LoRA variant
        self._model = jax.jit(
            _model_program,
            static_argnums=(0, 1, 2, 3),
            donate_argnums=(5,),
            out_shardings=(cache_shardings, whole, whole),
        )
        self._sampler = jax.jit(
            _sampler_program,
            static_argnums=(0,),
            donate_argnums=(3,),
            out_shardings=(cache_shardings.last_tokens, whole),
        )
        self._fused = jax.jit(
            _fused_decode_steps,
            static_argnums=(0, 1, 2, 3, 4),
            donate_argnums=(6,),
            out_shardings=(cache_shardings, whole),
        )
        self._prompt_logprobs = jax.jit(
            _prompt_logprobs_program,
            static_argnums=(0, 1, 2),
            donate_argnums=(4,),
            out_shardings=(cache_shardings, whole, whole, whole),
        )
        self.seed = jax.jit(_seed_penalty_rows, donate_argnums=(0,), out_shardings=cache_shardings)
        if carry is not None:
            self._ticks = {
                prompt: jax.jit(
                    _tick_program,
                    static_argnums=(0, 1, 2, 3, 4),
                    donate_argnums=(6, 7),
                    out_shardings=(cache_shardings, None, whole, whole) + ((whole,) if prompt else ()),
                )
                for prompt in (False, True)
            }

    @classmethod
    def for_engine(
        cls,
        config: EngineConfig,
        graphdef,
        parallel: TensorParallel,
        kv_dtype: str,
        params_dtype,
        fused_options: SamplerOptions = SamplerOptions(),
    ) -> "StepPrograms":
        """The programs of an engine: its packer (buckets from the engine's limits), the cache on
        the mesh (pool split by the sharding table, penalty tables whole) of a `kv_dtype` pool;
        under pipeline parallelism pipeline ticks carrying `params_dtype` activations."""
        limits, spec = config.scheduler_config(), config.speculative
        packer = StepPacker(
            block_size=limits.block_size,
            max_model_len=limits.max_model_len,
            max_num_seqs=limits.max_num_seqs,
            max_num_batched_tokens=limits.max_num_batched_tokens,
            vocab_size=config.model.vocab_size,
            rows_per_seq=1 + (spec.num_speculative_tokens if spec else 0),
        )
        whole, pool = parallel.sharding(), parallel.pool_sharding
        scales = parallel.logical_sharding(KV_SCALE_AXES)
        quant = KVQuant(k_scale=scales, v_scale=scales, dtype=kv_dtype) if is_fp8(kv_dtype) else None
        lora = None
        if config.lora.enable_lora:  # (whole on every device; GSPMD splits the deltas' products)
            names = lora_targets(config.layout.mesh_config)
            lora = LoraPool(a=dict.fromkeys(names, whole), b=dict.fromkeys(names, whole))
        shardings = DeviceCache(
            kv=KVPool(k=pool, v=pool, num_layers=config.layout.pipeline.num_virtual_layers, quant=quant),
            prompt_mask=whole,
            output_counts=whole,
            last_tokens=whole,
            lora=lora,
        )
        carry = None
        pipeline = config.layout.pipeline
        if pipeline.size > 1:
            staged = parallel.logical_sharding((STAGES,))
            carry = CarryShape(pipeline.size, config.model.hidden_size, params_dtype, staged, whole)
        return cls(graphdef, packer, limits.num_scheduler_steps, shardings, whole, fused_options, carry)

    def all(self) -> list[Program]:
        """Every model program: a mixed step (ragged attention) for each token bucket, and for each
        bucket a decode-only batch uses (one token per sequence) a decode step (the decode
        kernel) and, with `num_decode_steps` > 1, fused decode steps; with LoRA each of them also
        as the variant that computes the adapters' deltas (`Program.lora`)."""
        mixed = [Program(t, 1, False) for t in self.packer.layouts]
        max_num_seqs = self.packer.max_num_seqs
        decode_buckets = sorted({self.packer.bucket_for(n, n) for n in range(1, max_num_seqs + 1)})
        decode = [Program(t, 1, True) for t in decode_buckets]
        if self.num_decode_steps > 1:
            decode += [Program(t, self.num_decode_steps, True, self.fused_options) for t in decode_buckets]
        programs = mixed + decode
        if self.lora:
            programs += [p._replace(lora=True) for p in programs]
        return programs

    def samplers(self, programs: list[Program] | None = None) -> list[SamplerProgram]:
        """The sampler programs the 1-step model programs need, each of `ENGINE_SAMPLER_OPTIONS`."""
        layouts = {self.layout(p) for p in (programs or self.all()) if p.steps == 1}
        shapes = sorted({(lay.num_seqs, lay.rows_per_seq) for lay in layouts})
        return [SamplerProgram(s, r, o) for s, r in shapes for o in ENGINE_SAMPLER_OPTIONS]

    def layout(self, program: Program) -> Layout:
        return (self.packer.decode_layouts if program.decode else self.packer.layouts)[program.tokens]

    def describe(self, program: Program | SamplerProgram) -> str:
        """E.g. "mixed step, 64 tokens x 1 step(s), 8 seqs"."""
        if isinstance(program, SamplerProgram):
            return program.describe()
        return f"{program.describe()}, {self.packer.layouts[program.tokens].num_seqs} seqs"

    def lower(self, program: Program | SamplerProgram, params, cache: DeviceCache) -> jax.stages.Lowered:
        """Lowers one program for these parameters and this cache (arrays or shapes)."""
        if isinstance(program, SamplerProgram):
            return self._lower_sampler(program, cache)
        layout = self.layout(program)
        flat = jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=self.whole)  # whole on every device
        if program.steps > 1:
            return self._fused.lower(
                layout, program.steps, program.options, program.lora, self.graphdef, params, cache, flat
            )
        if self.carry is not None:
            carry = self.carry.shapes(layout, program.decode)
            tick = self._ticks[program.prompt_logprobs]
            return tick.lower(
                layout,
                program.decode,
                program.prompt_logprobs,
                self.carry,
                self.graphdef,
                params,
                cache,
                carry,
                flat,
                flat,
            )
        if program.prompt_logprobs:
            return self._prompt_logprobs.lower(layout, program.lora, self.graphdef, params, cache, flat)
        return self._model.lower(layout, program.decode, program.lora, self.graphdef, params, cache, flat)

    def _lower_sampler(self, program: SamplerProgram, cache: DeviceCache) -> jax.stages.Lowered:
        s, r = program.num_seqs, program.rows_per_seq
        rows = s * r
        vocab = cache.prompt_mask.shape[1]
        ints = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.whole)  # noqa: E731
        floats = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=self.whole)  # noqa: E731
        sampling = SamplingTensors(
            **{name: (floats if dtype == np.float32 else ints)(rows) for name, dtype in SAMPLING_FIELDS}
        )
        inp = SamplerInput(
            sampling=sampling,
            banned_ids=ints(rows, MAX_BANNED),
            last_slot=ints(s),
            proposals=ints(s, r - 1) if r > 1 else None,
            num_drafts=ints(s) if r > 1 else None,
            logit_bias_ids=ints(rows, MAX_LOGIT_BIAS),
            logit_bias_values=floats(rows, MAX_LOGIT_BIAS),
            token_mask=ints(rows, mask_words(vocab)) if program.options.mask else None,
        )
        return self._sampler.lower(
            program.options, cache.prompt_mask, cache.output_counts, cache.last_tokens, floats(rows, vocab), inp
        )

    def lower_seed(self, cache: DeviceCache) -> jax.stages.Lowered:
        """Lowers the program that seeds a penalty-table row (see `ModelRunner.seed_penalty_slot`)."""
        size = self.packer.pages * self.packer.block_size
        ints = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self.whole)
        flags = jax.ShapeDtypeStruct((size,), jnp.bool_, sharding=self.whole)
        return self.seed.lower(cache, ints, ints, flags, jax.ShapeDtypeStruct((1,), jnp.int32, sharding=self.whole))


@dataclasses.dataclass
class CompiledProgram:
    """One program compiled by `compile_all`, with the seconds its lowering and compiling took."""

    name: str
    executable: jax.stages.Compiled
    lower_s: float
    compile_s: float


def compile_all(
    jobs: list[tuple[str, Callable[[], jax.stages.Lowered]]],
    threads: int,
    log: Callable[[str], None] = lambda line: None,
) -> list[CompiledProgram]:
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
