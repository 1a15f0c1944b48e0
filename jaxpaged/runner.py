"""The device side of the engine: parameters, the cache, bucketed compiled steps, one transfer.

1. Buckets: a step's token count is padded to a power of two between 16 and
   `max_num_batched_tokens` (T); its sequence count to min(T, max_num_seqs) (S); block
   tables to the pages of `max_model_len` (P). Every bucket is compiled by `warm_up`.
2. Host packing: each bucket owns one preallocated int32 buffer; every step input (token
   ids, metadata, sampling parameters with floats bit-cast) is written into views of it,
   and the whole buffer goes to the device in one transfer. The compiled step slices it
   back into a `StepInput` and calls the pure `functional.step`.
3. The cache (KV pool + penalty tables) is donated to each step and rebound to its result.
"""

import dataclasses
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpaged.functional import DeviceCache, StepInput, init_cache, step
from jaxpaged.model import AttentionMetadata, Llama
from jaxpaged.sampler import MAX_BANNED, SampleResult, SamplingTensors, update_penalty_tables
from jaxpaged.step_inputs import ScheduledSequence

logger = logging.getLogger("jaxpaged")

MIN_TOKEN_BUCKET = 16
# Rows of `SamplingTensors`, in the order they sit in the packed buffer; floats are bit-cast.
SAMPLING_FIELDS = (
    ("temperature", np.float32), ("top_k", np.int32), ("top_p", np.float32), ("min_p", np.float32),
    ("presence_penalty", np.float32), ("frequency_penalty", np.float32), ("repetition_penalty", np.float32),
    ("seed", np.int32), ("index", np.int32), ("position", np.int32), ("slot", np.int32),
)  # fmt: skip


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Powers of two from 16 up to the first one >= max_num_batched_tokens."""
    sizes = [MIN_TOKEN_BUCKET]
    while sizes[-1] < max_num_batched_tokens:
        sizes.append(sizes[-1] * 2)
    return sizes


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each field sits in a bucket's flat int32 buffer."""

    num_tokens: int  # T
    num_seqs: int  # S
    pages: int  # P

    @property
    def fields(self) -> list[tuple[str, tuple[int, ...]]]:
        t, s, p = self.num_tokens, self.num_seqs, self.pages
        return [
            ("token_ids", (t,)), ("positions", (t,)), ("slot_mapping", (t,)), ("token_slot", (t,)),
            ("token_is_output", (t,)), ("cu_q_lens", (s + 1,)), ("kv_lens", (s,)), ("logits_indices", (s,)),
            ("reset_slots", (s,)), ("sampling", (len(SAMPLING_FIELDS), s)), ("block_tables", (s, p)),
            ("banned_ids", (s, MAX_BANNED)),
            ("num_seqs", ()), ("want_logprobs", ()),
        ]  # fmt: skip

    @property
    def size(self) -> int:
        return sum(int(np.prod(shape)) for _, shape in self.fields)

    def views(self, flat):
        """Splits a flat buffer (numpy or jax) into named, shaped views."""
        out, start = {}, 0
        for name, shape in self.fields:
            n = int(np.prod(shape))
            out[name] = flat[start : start + n].reshape(shape)
            start += n
        return out


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


def _seed_penalty_rows(cache: DeviceCache, token_ids, token_slot, token_is_output, reset_slots) -> DeviceCache:
    prompt_mask, output_counts = update_penalty_tables(
        cache.prompt_mask, cache.output_counts, token_ids, token_slot, token_is_output, reset_slots
    )
    return DeviceCache(kv=cache.kv, prompt_mask=prompt_mask, output_counts=output_counts)


@dataclasses.dataclass(frozen=True)
class SequenceRow:
    """What the runner needs of one scheduled sequence besides its `ScheduledSequence`.

    Attributes:
      sampling: int32 `[len(SAMPLING_FIELDS)]`, the sequence's sampling row (floats bit-cast;
        `position` and `slot` are filled per step).
      slot: its penalty-table row.
      prompt_len: tokens of its prompt (later positions are generated tokens).
      want_logprobs: whether it asked for top logprobs.
      banned_ids: token ids it may not sample this step (EOS / stop tokens before min_tokens).
    """

    sampling: np.ndarray
    slot: int
    prompt_len: int
    want_logprobs: bool
    banned_ids: tuple[int, ...] = ()


def sampling_row(params, index: int) -> np.ndarray:
    """The int32 sampling row of a `SamplingParams` (its seed already resolved) for completion `index`."""
    values = {
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_k": max(params.top_k, 0),
        "top_p": params.top_p,
        "min_p": params.min_p,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "seed": params.seed,
        "index": index,
        "position": 0,
        "slot": 0,
    }
    return np.array([np.array(values[n], d).view(np.int32) for n, d in SAMPLING_FIELDS], np.int32)


class ModelRunner:
    """Runs engine steps on the device.

    Args:
      model: the NNX model (split once; params are placed on `mesh`).
      mesh: the engine's device mesh (axis "tp").
      num_blocks: KV blocks, including the null block 0.
      block_size: tokens per block.
      max_num_seqs, max_num_batched_tokens, max_model_len: the scheduler's limits.
      kv_dtype: dtype of the KV pool.
    """

    def __init__(self, model: Llama, *, mesh: Mesh, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_dtype):  # fmt: skip
        self.config = model.config
        self.mesh = mesh
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.pages = -(-max_model_len // block_size)
        graphdef, params = nnx.split(model)
        self.graphdef = graphdef
        replicated = NamedSharding(mesh, PartitionSpec())
        self.params = jax.device_put(params, replicated)
        kv_sharding = NamedSharding(mesh, PartitionSpec(None, None, "tp", None))
        cache = init_cache(self.config, num_blocks=num_blocks, block_size=block_size, dtype=kv_dtype,
                           max_num_seqs=max_num_seqs)  # fmt: skip
        self.cache = DeviceCache(
            kv=jax.device_put(cache.kv, kv_sharding),
            prompt_mask=jax.device_put(cache.prompt_mask, replicated),
            output_counts=jax.device_put(cache.output_counts, replicated),
        )
        self.layouts = {t: Layout(t, min(t, max_num_seqs), self.pages) for t in token_buckets(max_num_batched_tokens)}
        self.buffers = {t: np.zeros(layout.size, np.int32) for t, layout in self.layouts.items()}
        self._step = jax.jit(_packed_step, static_argnums=(0, 1), donate_argnums=(3,))
        self._seed = jax.jit(_seed_penalty_rows, donate_argnums=(0,))
        self.compiled: dict[int, object] = {}

    def compile_bucket(self, t: int):
        """Compiles (and keeps) the step for token bucket `t`."""
        layout = self.layouts[t]
        flat = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
        self.compiled[t] = self._step.lower(layout, self.graphdef, self.params, self.cache, flat).compile()
        return self.compiled[t]

    def warm_up(self) -> float:
        """Compiles every bucket; returns the seconds it took."""
        start = time.perf_counter()
        for t in self.layouts:
            self.compile_bucket(t)
        self.seed_penalty_slot(0, [], 0)  # compiles the seeding step too
        seconds = time.perf_counter() - start
        logger.info("compiled %d step buckets %s in %.1f s", len(self.layouts), sorted(self.layouts), seconds)
        return seconds

    def bucket_for(self, num_tokens: int, num_seqs: int) -> int:
        for t, layout in self.layouts.items():
            if num_tokens <= t and num_seqs <= layout.num_seqs:
                return t
        raise ValueError(f"{num_tokens} tokens / {num_seqs} sequences exceed every step bucket")

    def pack(self, inputs: list[ScheduledSequence], rows: list[SequenceRow], resets: list[int]) -> tuple[int, np.ndarray]:
        """Writes one step into its bucket's buffer; returns (bucket, buffer)."""
        num_tokens = sum(len(s.token_ids) for s in inputs)
        t = self.bucket_for(num_tokens, len(inputs))
        layout, flat = self.layouts[t], self.buffers[t]
        v = layout.views(flat)
        flat.fill(0)
        padding_slot = self.max_num_seqs  # an out-of-range penalty row: dropped
        v["token_slot"][:] = padding_slot
        v["reset_slots"][:] = padding_slot
        v["reset_slots"][: len(resets)] = resets
        v["cu_q_lens"][:] = num_tokens
        v["banned_ids"][:] = self.config.vocab_size  # out of range: dropped
        sampling = v["sampling"]
        bs, start = self.block_size, 0
        for i, (seq, row) in enumerate(zip(inputs, rows)):
            n = len(seq.token_ids)
            end = start + n
            kv_len = seq.num_computed + n
            pos = np.arange(seq.num_computed, kv_len, dtype=np.int32)
            pages = -(-kv_len // bs)
            table = v["block_tables"][i]
            table[:pages] = seq.block_table[:pages]
            v["token_ids"][start:end] = seq.token_ids
            v["positions"][start:end] = pos
            v["slot_mapping"][start:end] = table[pos // bs] * bs + pos % bs
            v["token_slot"][start:end] = row.slot
            v["token_is_output"][start:end] = pos >= row.prompt_len
            v["cu_q_lens"][i] = start
            v["kv_lens"][i] = kv_len
            v["logits_indices"][i] = end - 1
            sampling[:, i] = row.sampling
            if row.banned_ids:
                v["banned_ids"][i, : len(row.banned_ids)] = row.banned_ids
            start = end
        positions = np.asarray(v["kv_lens"][: len(inputs)])  # the sampled token's position
        sampling[[n for n, _ in SAMPLING_FIELDS].index("position"), : len(inputs)] = positions
        sampling[[n for n, _ in SAMPLING_FIELDS].index("slot"), : len(inputs)] = [r.slot for r in rows]
        v["num_seqs"][...] = len(inputs)
        v["want_logprobs"][...] = any(r.want_logprobs for r in rows)
        return t, flat

    def seed_penalty_slot(self, slot: int, token_ids: list[int], prompt_len: int) -> None:
        """Resets penalty row `slot` and records tokens a sequence got from the prefix cache
        (the steps only see tokens they compute)."""
        size = self.pages * self.block_size
        ids = np.zeros(size, np.int32)
        ids[: len(token_ids)] = token_ids
        slots = np.full(size, self.max_num_seqs, np.int32)
        slots[: len(token_ids)] = slot
        is_output = np.arange(size) >= prompt_len
        self.cache = self._seed(self.cache, ids, slots, is_output, np.array([slot], np.int32))

    def execute(self, inputs: list[ScheduledSequence], rows: list[SequenceRow], resets: list[int]) -> SampleResult:
        """Packs, transfers and runs one step; returns its (not yet fetched) device result."""
        t, flat = self.pack(inputs, rows, resets)
        compiled = self.compiled.get(t)
        if compiled is None:
            raise RuntimeError(f"step bucket {t} was not compiled: call warm_up() first")
        self.cache, result = compiled(self.params, self.cache, jax.device_put(flat))
        return result
