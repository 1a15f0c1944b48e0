"""`Llama.pipeline_tick`: micro-batches carried through the pipeline stages one tick per call
(8 fake CPU devices, 1 device per stage) give what `Llama._pipelined` gives them in one step and
what the unsharded model gives, hidden states and KV pool alike.

The tiny model (tiny_models' llama_pp) has 5 decoder layers: 2 stages split them 3 + 2, 4 stages
2 + 1 + 1 + 1 (shorter stages pass activations through an empty slot). Every pool starts NaN
(poisoned): a block no sequence owns must come out NaN, and any stray read would poison a
hidden state. Four sequences share 24 shuffled blocks per layer, leaving some unowned.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_models import save_hf_model

from jaxpaged.checkpoint.loader import load_model
from jaxpaged.engine_args import EngineArgs
from jaxpaged.engine_config import EngineConfig
from jaxpaged.model import AttentionMetadata, init_kv_pool
from jaxpaged.parallel.mesh import TensorParallel, make_mesh

BS, NB = 4, 24  # block size; blocks per layer, the null block 0 included
PROMPT_LENS = (5, 6, 3, 1)  # 15 tokens of a 16-token prefill step: sequences straddle the micro-batches
ROUNDS = 3  # decode tokens per sequence in the steady-state test
PAGES = 3  # block table width: a sequence holds at most 6 + ROUNDS tokens (<= 12)
TABLES = np.random.default_rng(0).permutation(np.arange(1, NB))[: len(PROMPT_LENS) * PAGES].reshape(-1, PAGES)
UNOWNED = sorted(set(range(1, NB)) - set(TABLES.flat))  # never written: NaN to the end


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the unsharded model, {P: the model over P stages of one device each})."""
    path = str(tmp_path_factory.mktemp("llama_pp"))
    save_hf_model("llama_pp", path)

    def staged(pp):
        args = EngineArgs(model=path, dtype="float32", pipeline_parallel_size=pp, skip_tokenizer_init=True)
        layout = EngineConfig.resolve(args).layout
        return load_model(path, "float32", parallel=TensorParallel(layout, make_mesh(1, None, pp)))[1]

    return load_model(path, "float32")[1], {pp: staged(pp) for pp in (2, 4)}


def metadata(seqs, num_tokens: int, rows: int, decode_only: bool = False) -> AttentionMetadata:
    """A step of `seqs`, `(sequence, first position, new tokens)` each, padded to `num_tokens`
    tokens and `rows` sequence rows."""
    positions = [p for _, start, n in seqs for p in range(start, start + n)]
    slots = [int(TABLES[s][p // BS]) * BS + p % BS for s, start, n in seqs for p in range(start, start + n)]
    pad, empty = num_tokens - len(positions), rows - len(seqs)
    cu = np.cumsum([0] + [n for *_, n in seqs]).tolist()
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return AttentionMetadata(
        positions=i32(positions + [0] * pad),
        slot_mapping=i32(slots + [0] * pad),
        cu_q_lens=i32(cu + [cu[-1]] * empty),
        kv_lens=i32([start + n for _, start, n in seqs] + [0] * empty),
        block_tables=i32([TABLES[s].tolist() for s, *_ in seqs] + [[0] * PAGES] * empty),
        num_seqs=i32(len(seqs)),
        decode_only=decode_only,
    )


def poisoned_pool(model):
    pool = init_kv_pool(model.pool_config, NB, BS, jnp.float32)
    k, v = jnp.full_like(pool.k, jnp.nan), jnp.full_like(pool.v, jnp.nan)
    if model.parallel is not None:
        k, v = (jax.device_put(a, model.parallel.pool_sharding) for a in (k, v))
    return dataclasses.replace(pool, k=k, v=v)


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, token_ids, pool, meta):
    """One step of the whole model (`_pipelined` under pipeline parallelism): hidden, pool."""
    return nnx.merge(graphdef, state)(token_ids, pool, meta)


@functools.partial(jax.jit, static_argnums=0)
def _tick(graphdef, state, carry, token_ids, pool, meta, entering):
    return nnx.merge(graphdef, state).pipeline_tick(carry, token_ids, pool, meta, entering)


@functools.partial(jax.jit, static_argnums=0)
def _greedy(graphdef, state, hidden):
    return jnp.argmax(nnx.merge(graphdef, state).compute_logits(hidden), axis=-1)


def step(model, token_ids, pool, meta):
    return _step(*nnx.split(model), jnp.asarray(token_ids, jnp.int32), pool, meta)


def tick(model, carry, token_ids, pool, meta, entering=True):
    """`pipeline_tick` (one compiled program for filling, steady state and draining)."""
    return _tick(*nnx.split(model), carry, jnp.asarray(token_ids, jnp.int32), pool, meta, jnp.asarray(entering))


def greedy(model, hidden) -> list[int]:
    return np.asarray(_greedy(*nnx.split(model), hidden)).tolist()


def through_ticks(model, pool, micro: list[tuple[list[int], AttentionMetadata]]):
    """Every micro-batch `(tokens, meta)` fed in order through M + P - 1 ticks from an empty
    carry: (the exiting hidden states in order, the pool), checking one leaves per tick from
    tick P - 1 on and the carry is empty at the end."""
    stages = model.pipeline.size
    carry = model.init_pipeline_carry(micro[0][1])
    exits = []
    for t in range(len(micro) + stages - 1):
        tokens, meta = micro[min(t, len(micro) - 1)]
        hidden, exited, carry, pool = tick(model, carry, tokens, pool, meta, t < len(micro))
        assert bool(exited) == (t >= stages - 1), t
        if exited:
            exits.append(hidden)
        else:  # the pipeline filling: nothing leaves, and nothing but zeros comes out
            assert not np.asarray(hidden).any()
    assert not np.asarray(carry.busy).any() and not np.asarray(carry.hidden).any()
    return jnp.concatenate(exits), pool


def layer_blocks(pool, virtual_layer: int) -> np.ndarray:
    """One (virtual) layer's K and V blocks but its null block: `[2, NB - 1, BS, K, H]`."""
    blocks = slice(virtual_layer * NB + 1, (virtual_layer + 1) * NB)
    return np.stack([np.asarray(pool.k)[blocks], np.asarray(pool.v)[blocks]])


def assert_pools_equal(staged, pool, reference_pool, flat_pool=None):
    """`pool` and `reference_pool` (both over the stages) equal in every virtual layer, the
    unsharded `flat_pool` (when given) in every decoder layer; unowned blocks NaN throughout.
    Null blocks are left out: idle stages and padding tokens write there."""
    pipe = staged.pipeline
    for layer in range(pipe.num_virtual_layers):
        got = layer_blocks(pool, layer)
        np.testing.assert_array_equal(got, layer_blocks(reference_pool, layer))
        assert np.isnan(got[:, [b - 1 for b in UNOWNED]]).all(), f"an unowned block of slot {layer} was written"
        assert not np.isnan(got[:, [b - 1 for b in TABLES[:, 0]]]).all(), f"slot {layer} wrote nothing"
    for layer in range(staged.config.num_layers if flat_pool is not None else 0):
        np.testing.assert_allclose(
            layer_blocks(pool, pipe.virtual_layer(layer)), layer_blocks(flat_pool, layer), rtol=1e-5, atol=1e-5
        )


def prefill(flat):
    """The four prompts in one 16-token step (tokens, metadata)."""
    tokens = np.random.default_rng(1).integers(3, flat.config.vocab_size, 16).tolist()
    seqs = [(s, 0, n) for s, n in enumerate(PROMPT_LENS)]
    return tokens, metadata(seqs, 16, len(PROMPT_LENS))


def groups(stages: int) -> list[list[int]]:
    """The sequences split into one group per stage (decode micro-batches of 2 rows)."""
    return [list(g) for g in np.array_split(np.arange(len(PROMPT_LENS)), stages)]


def decode_meta(group: list[int], lengths: list[int]) -> AttentionMetadata:
    """One decode token for each sequence of `group`, the sequences holding `lengths` tokens."""
    return metadata([(s, lengths[s], 1) for s in group], 2, 2, decode_only=True)


@pytest.mark.parametrize("stages", [2, 4])
def test_ticks_give_one_pipelined_step_and_the_unsharded_model(models, stages):
    """A prefill step's M = P micro-batches (sequences cut by their boundaries), then P decode
    micro-batches of different sequences, through M + P - 1 ticks each: the exiting hidden
    states in order and the pool equal `_pipelined`'s (one step; one decode step per
    micro-batch) and the unsharded model's."""
    flat, staged = models[0], models[1][stages]
    tokens, meta = prefill(flat)
    num_micro = staged.pipeline.microbatches_for(16)
    assert num_micro == stages
    size = 16 // num_micro
    micro = [(tokens[m * size : (m + 1) * size], meta.microbatch(m, num_micro)) for m in range(num_micro)]
    hidden, pool = through_ticks(staged, poisoned_pool(staged), micro)
    expected, expected_pool = step(staged, tokens, poisoned_pool(staged), meta)
    unsharded, flat_pool = step(flat, tokens, poisoned_pool(flat), meta)
    np.testing.assert_array_equal(hidden, expected)
    np.testing.assert_allclose(hidden[:15], unsharded[:15], rtol=1e-5, atol=1e-5)
    assert_pools_equal(staged, pool, expected_pool, flat_pool)

    next_tokens = greedy(flat, unsharded)
    lengths = list(PROMPT_LENS)
    last = np.cumsum(PROMPT_LENS) - 1  # each prompt's last row
    micro, expected, unsharded = [], [], []
    for group in groups(stages):
        ids = [next_tokens[last[s]] for s in group] + [0] * (2 - len(group))
        d = decode_meta(group, lengths)
        micro.append((ids, d))
        h, expected_pool = step(staged, ids, expected_pool, d)
        expected.append(h)
        h, flat_pool = step(flat, ids, flat_pool, d)
        unsharded.append(h)
    hidden, pool = through_ticks(staged, pool, micro)
    np.testing.assert_array_equal(hidden, jnp.concatenate(expected))
    rows = np.concatenate([np.arange(len(g)) + 2 * i for i, g in enumerate(groups(stages))])  # not padding
    np.testing.assert_allclose(hidden[rows], jnp.concatenate(unsharded)[rows], rtol=1e-5, atol=1e-5)
    assert_pools_equal(staged, pool, expected_pool, flat_pool)


@pytest.mark.parametrize("stages", [2, 4])
def test_steady_state_every_stage_busy_with_its_own_group(models, stages):
    """Greedy decoding with the sequences in P rotating groups, as the carried pipeline will
    run it: group g enters at ticks g, g + P, ... with the token its previous micro-batch left
    with at the tick before. Once the pipeline is full every stage is busy at every tick, stage
    s with group (t - s) mod P, and the tokens, hidden states and pool are the unsharded
    model's decoding each group step by step (and `_pipelined`'s, one decode step each)."""
    flat, staged = models[0], models[1][stages]
    tokens, meta = prefill(flat)
    _, pool = step(staged, tokens, poisoned_pool(staged), meta)
    expected_pool = pool
    unsharded, flat_pool = step(flat, tokens, poisoned_pool(flat), meta)
    first = greedy(flat, unsharded)
    every = groups(stages)
    lengths = list(PROMPT_LENS)
    entering = {g: [first[n - 1] for n in np.cumsum(PROMPT_LENS)[group]] for g, group in enumerate(every)}
    carry = staged.init_pipeline_carry(decode_meta(every[0], lengths))
    generated = {s: [] for s in range(len(PROMPT_LENS))}
    metas = {}  # tick -> the metadata of the micro-batch that entered
    for t in range(ROUNDS * stages + stages - 1):
        g = t % stages
        feeding = t < ROUNDS * stages
        ids = entering[g] + [0] * (2 - len(every[g]))
        metas[t] = decode_meta(every[g], lengths)
        hidden, exited, carry, pool = tick(staged, carry, ids, pool, metas[t], feeding)
        if feeding:
            for s in every[g]:
                lengths[s] += 1
            want, flat_pool = step(flat, ids, flat_pool, metas[t])  # the same micro-batch, unsharded
            pipelined, expected_pool = step(staged, ids, expected_pool, metas[t])
            metas[t] = (metas[t], want, pipelined)
        busy = np.concatenate([np.asarray(carry.busy)[1:], [bool(exited)]])  # each stage during tick t
        np.testing.assert_array_equal(busy, [0 <= t - s < ROUNDS * stages for s in range(stages)])
        if stages - 1 <= t < ROUNDS * stages:
            assert busy.all(), t
            for s in range(1, stages):  # stage s - 1's micro-batch at tick t goes to stage s: group (t - s + 1)
                np.testing.assert_array_equal(carry.meta.block_tables[s], metas[t - s + 1][0].block_tables)
        if not exited:
            continue
        done = t - stages + 1  # the tick the leaving micro-batch entered at
        _, want, pipelined = metas[done]
        group = every[done % stages]
        np.testing.assert_array_equal(hidden, pipelined)
        np.testing.assert_allclose(hidden[: len(group)], want[: len(group)], rtol=1e-5, atol=1e-5)
        out = greedy(staged, hidden)
        assert out[: len(group)] == greedy(flat, want)[: len(group)]
        for row, s in enumerate(group):
            generated[s].append(out[row])
        entering[done % stages] = out[: len(group)]  # its next micro-batch enters at the next tick
    assert [len(t) for t in generated.values()] == [ROUNDS] * len(PROMPT_LENS)
    assert_pools_equal(staged, pool, expected_pool, flat_pool)


def test_a_micro_batch_not_shaped_as_the_carry_is_refused(models):
    """The carry's micro-batches have one shape and one attention kernel: another is refused
    when the tick is traced, naming what differs."""
    staged = models[1][2]
    carry = staged.init_pipeline_carry(decode_meta([0, 1], list(PROMPT_LENS)))
    pool = jax.eval_shape(lambda: poisoned_pool(staged))

    def trace(ids, meta):
        return jax.eval_shape(lambda c, p: staged.pipeline_tick(c, jnp.asarray(ids, jnp.int32), p, meta), carry, pool)

    with pytest.raises(ValueError, match="decode_only=False"):
        trace([1, 2], metadata([(0, 5, 1), (1, 6, 1)], 2, 2))
    with pytest.raises(ValueError, match="activations are"):
        trace([1, 2, 3], decode_meta([0, 1, 2], list(PROMPT_LENS)))
    with pytest.raises(ValueError, match=r"cu_q_lens is \(4,\)"):
        trace([1, 2], metadata([(0, 5, 1), (1, 6, 1)], 2, 3, decode_only=True))
    with pytest.raises(ValueError, match="needs pipeline parallelism"):
        models[0].init_pipeline_carry(decode_meta([0, 1], list(PROMPT_LENS)))
