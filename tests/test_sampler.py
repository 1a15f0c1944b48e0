"""The device sampler: greedy, seeded sampling, filters, penalties and logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.model.sampler import MAX_LOGPROBS, SamplerOptions, SamplingTensors, sample, update_penalty_tables

V = 64
ROWS = 8


def tensors(s, **overrides):
    base = dict(
        temperature=np.ones(s, np.float32),
        top_k=np.zeros(s, np.int32),
        top_p=np.ones(s, np.float32),
        min_p=np.zeros(s, np.float32),
        presence_penalty=np.zeros(s, np.float32),
        frequency_penalty=np.zeros(s, np.float32),
        repetition_penalty=np.ones(s, np.float32),
        seed=np.arange(s, dtype=np.int32),
        index=np.zeros(s, np.int32),
        position=np.zeros(s, np.int32),
        slot=np.arange(s, dtype=np.int32),
        ban_until=np.full(s, 1 << 30, np.int32),
    )
    base.update({k: np.asarray(v, base[k].dtype) for k, v in overrides.items()})
    return SamplingTensors(**{k: jnp.asarray(v) for k, v in base.items()})


def empty_tables():
    return jnp.zeros((ROWS, V), bool), jnp.zeros((ROWS, V), jnp.int32)


def run(logits, params, tables=None, want_logprobs=False, banned=None, filter=None):
    """The sampler as the engine runs it: the filtering path on when a row filters (or `filter`)."""
    prompt_mask, counts = tables or empty_tables()
    banned = np.full((len(logits), 2), V, np.int32) if banned is None else np.asarray(banned, np.int32)
    if filter is None:
        filter = bool(np.any(np.asarray(params.top_k) > 0) or np.any(np.asarray(params.top_p) < 1))
    options = SamplerOptions(filter=filter, logprobs=want_logprobs)
    return jax.jit(sample, static_argnums=5)(
        jnp.asarray(logits, jnp.float32), params, prompt_mask, counts, jnp.asarray(banned), options
    )


def random_logits(s, seed=0):
    return np.random.default_rng(seed).standard_normal((s, V)).astype(np.float32) * 3


def test_greedy_is_argmax():
    logits = random_logits(4)
    out = run(logits, tensors(4, temperature=[0, 0, 0, 0]))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))


def test_seeded_sample_does_not_depend_on_the_batch():
    logits = random_logits(1)
    alone = run(logits, tensors(1, seed=[1234], position=[17])).token_ids[0]
    batch_logits = np.concatenate([random_logits(5, seed=9), logits])
    seeds, positions = list(range(5)) + [1234], [3] * 5 + [17]
    in_batch = run(batch_logits, tensors(6, seed=seeds, position=positions)).token_ids[5]
    assert int(alone) == int(in_batch)


def test_samples_follow_the_tempered_distribution():
    logits = np.tile(random_logits(1, seed=3)[:, :8], (4096, 1))
    logits = np.pad(logits, ((0, 0), (0, V - 8)), constant_values=-1e9)
    out = run(logits, tensors(4096, temperature=np.full(4096, 0.7), position=np.arange(4096), slot=np.zeros(4096)))
    freq = np.bincount(np.asarray(out.token_ids), minlength=V)[:8] / 4096
    expected = jax.nn.softmax(logits[0, :8] / 0.7)
    np.testing.assert_allclose(freq, expected, atol=0.03)


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = random_logits(4, seed=5)
    out = run(logits, tensors(4, top_k=[1, 1, 0, 0], top_p=[1, 1, 1e-6, 1e-6], position=[1, 2, 3, 4]))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))


def test_top_k_keeps_only_the_k_best():
    logits = np.tile(random_logits(1, seed=6), (512, 1))
    out = run(logits, tensors(512, top_k=np.full(512, 3), position=np.arange(512), slot=np.zeros(512)))
    assert set(np.asarray(out.token_ids).tolist()) <= set(np.argsort(-logits[0])[:3].tolist())


def test_min_p_removes_unlikely_tokens():
    logits = np.full((256, V), -5.0, np.float32)
    logits[:, 0], logits[:, 1] = 5.0, 4.5
    out = run(logits, tensors(256, min_p=np.full(256, 0.1), position=np.arange(256), slot=np.zeros(256)))
    assert set(np.asarray(out.token_ids).tolist()) <= {0, 1}


def test_penalties_follow_vllm_formulas():
    logits = random_logits(1, seed=7)
    prompt_mask, counts = empty_tables()
    token_ids = jnp.asarray([5, 9, 9, 9, 11], jnp.int32)
    is_output = jnp.asarray([False, True, True, True, True])
    prompt_mask, counts = update_penalty_tables(
        prompt_mask, counts, token_ids, jnp.zeros(5, jnp.int32), is_output, jnp.asarray([0], jnp.int32)
    )
    expected = logits[0].copy()
    for tok in (5, 9, 11):  # repetition: prompt and output tokens
        expected[tok] = expected[tok] / 1.5 if expected[tok] > 0 else expected[tok] * 1.5
    expected[9] -= 0.5 * 3 + 0.25
    expected[11] -= 0.5 * 1 + 0.25
    out = run(
        logits,
        tensors(1, temperature=[0], repetition_penalty=[1.5], frequency_penalty=[0.5], presence_penalty=[0.25]),
        (prompt_mask, counts),
    )
    assert int(out.token_ids[0]) == int(expected.argmax())
    # The penalty changes the greedy choice when the favourite token was already generated.
    logits = np.zeros((1, V), np.float32)
    logits[0, 9], logits[0, 3] = 2.0, 1.0
    out = run(logits, tensors(1, temperature=[0], frequency_penalty=[1.0]), (prompt_mask, counts))
    assert int(out.token_ids[0]) == 3


def test_reset_clears_a_slot():
    prompt_mask, counts = empty_tables()
    ids = jnp.asarray([1, 2], jnp.int32)
    prompt_mask, counts = update_penalty_tables(
        prompt_mask, counts, ids, jnp.asarray([2, 2]), jnp.asarray([False, True]), jnp.asarray([ROWS], jnp.int32)
    )
    assert bool(prompt_mask[2, 1]) and int(counts[2, 2]) == 1
    prompt_mask, counts = update_penalty_tables(
        prompt_mask, counts, jnp.asarray([7], jnp.int32), jnp.asarray([ROWS]), jnp.asarray([True]), jnp.asarray([2])
    )
    assert not bool(prompt_mask[2].any()) and int(counts[2].sum()) == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_are_the_raw_log_softmax(temperature):
    logits = random_logits(3, seed=8)
    out = run(logits, tensors(3, temperature=[temperature] * 3), want_logprobs=True)
    logprobs = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    chosen = logprobs[np.arange(3), np.asarray(out.token_ids)]
    np.testing.assert_allclose(out.logprobs, chosen, rtol=1e-5)
    np.testing.assert_array_equal(out.top_ids[:, 0], logits.argmax(-1))
    np.testing.assert_array_equal(out.ranks, 1 + (logprobs > chosen[:, None]).sum(-1))
    np.testing.assert_allclose(out.top_logprobs, -np.sort(-logprobs, axis=-1)[:, :MAX_LOGPROBS], rtol=1e-5)


def test_banned_ids_are_never_sampled():
    logits = random_logits(2, seed=11)
    best = logits.argmax(-1)
    banned = [[best[0], V], [V, V]]
    out = run(logits, tensors(2, temperature=[0, 0]), banned=banned)
    assert int(out.token_ids[0]) != best[0] and int(out.token_ids[1]) == best[1]


def test_banned_ids_apply_only_before_ban_until():
    """min_tokens on the device: a row's banned ids hold while the sampled position is below its
    `ban_until` (a fused window crosses it mid-way)."""
    logits = np.repeat(random_logits(1, seed=12), 3, axis=0)
    best = int(logits[0].argmax())
    banned = [[best, V]] * 3
    out = run(logits, tensors(3, temperature=[0] * 3, position=[9, 10, 11], ban_until=[10] * 3), banned=banned)
    assert np.asarray(out.token_ids).tolist()[1:] == [best, best] and int(out.token_ids[0]) != best


def test_the_filtering_path_leaves_unfiltered_rows_exactly_as_they_are():
    """A row without top-k / top-p samples the same token whether or not its batch takes the
    filtering path (another row filters), seeded and sampled alike; so do the logprobs paths."""
    logits = random_logits(64, seed=13)
    params = tensors(64, temperature=np.full(64, 0.9), position=np.arange(64), slot=np.zeros(64))
    plain = run(logits, params, filter=False)
    filtered = run(logits, params, filter=True, want_logprobs=True)
    np.testing.assert_array_equal(plain.token_ids, filtered.token_ids)
    np.testing.assert_array_equal(plain.logprobs, filtered.logprobs)
    assert plain.top_ids.shape == (64, 0) and filtered.top_ids.shape == (64, MAX_LOGPROBS)
