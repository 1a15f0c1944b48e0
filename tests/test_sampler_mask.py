"""The sampler's token mask (structured outputs, allowed_token_ids, bad_words): at temperature 1
the masked distribution is the unconstrained one renormalised over the allowed tokens; greedy
picks the likeliest allowed token; logprobs stay the raw model's; an all-ones mask changes
nothing; ids past the tokenizer's vocabulary are never allowed by a grammar."""

import jax
import jax.numpy as jnp
import numpy as np
from test_sampler import V, tensors

from jaxpaged.model.sampler import SamplerOptions, sample
from jaxpaged.structured.backend import pack_bits, tokenizer_mask

ROWS = 20_000


def masked_sample(logits, params, mask_bits, options=SamplerOptions(mask=True)):
    rows = logits.shape[0]
    tables = jnp.zeros((rows, V), bool), jnp.zeros((rows, V), jnp.int32)
    banned = jnp.full((rows, 1), V, jnp.int32)
    return jax.jit(sample, static_argnums=5)(
        jnp.asarray(logits), params, *tables, banned, options, None if mask_bits is None else jnp.asarray(mask_bits)
    )


def test_masked_distribution_is_the_renormalised_one():
    rng = np.random.default_rng(0)
    row = rng.standard_normal(V).astype(np.float32) * 1.5
    allowed = np.zeros(V, bool)
    allowed[rng.choice(V, 12, replace=False)] = True
    logits = np.broadcast_to(row, (ROWS, V))
    bits = np.broadcast_to(pack_bits(allowed[None]), (ROWS, V // 32))
    result = masked_sample(logits, tensors(ROWS, position=np.arange(ROWS)), bits)
    counts = np.bincount(np.asarray(result.token_ids), minlength=V)
    assert counts[~allowed].sum() == 0
    p = np.exp(row[allowed] - row[allowed].max())
    expected = ROWS * p / p.sum()
    chi2 = float(((counts[allowed] - expected) ** 2 / expected).sum())
    assert chi2 < 35.0, chi2  # 11 degrees of freedom: P(chi2 > 35) < 0.001
    raw = jax.nn.log_softmax(jnp.asarray(row))
    np.testing.assert_allclose(np.asarray(result.logprobs), np.asarray(raw)[np.asarray(result.token_ids)], rtol=1e-6)


def test_greedy_takes_the_likeliest_allowed_token_and_all_ones_change_nothing():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((8, V)).astype(np.float32)
    allowed = rng.random((8, V)) < 0.3
    allowed[:, 0] = True
    params = tensors(8, temperature=np.zeros(8))
    got = masked_sample(logits, params, pack_bits(allowed))
    np.testing.assert_array_equal(np.asarray(got.token_ids), np.where(allowed, logits, -np.inf).argmax(axis=1))
    ones = np.full((8, V // 32), -1, np.int32)
    sampled = tensors(8, position=np.arange(8))
    with_ones = masked_sample(logits, sampled, ones)
    without = masked_sample(logits, sampled, None, SamplerOptions())
    np.testing.assert_array_equal(np.asarray(with_ones.token_ids), np.asarray(without.token_ids))


def test_ids_past_the_tokenizer_are_never_allowed():
    bits = tokenizer_mask(tokenizer_size=40, vocab_size=V)
    unpacked = (bits[:, None] >> np.arange(32)) & 1
    assert unpacked.ravel().tolist() == [1] * 40 + [0] * (V - 40)
