"""The jnp reference attention equals plain dense causal attention, whatever the pool holds elsewhere.

Every block not owned by a sequence (the null block included) is filled with NaN: a stray read
anywhere poisons the output.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compiling_for, reference

BLOCK_SIZE = 16


def dense_attention(q, k, v, q_positions, window=None):
    """float64 causal attention of queries at `q_positions` over keys 0..len(k)-1 (with `window`:
    the keys at positions > query - window only)."""
    t, n, h = q.shape
    kh = k.shape[1]
    g = n // kh
    k = np.repeat(k, g, axis=1)
    v = np.repeat(v, g, axis=1)
    scores = np.einsum("tnh,lnh->ntl", q, k) * h**-0.5
    key_pos, q_pos = np.arange(len(k))[None, :], np.asarray(q_positions)[:, None]
    mask = (key_pos <= q_pos) & (True if window is None else key_pos > q_pos - window)
    scores = np.where(mask[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("ntl,lnh->tnh", probs, v)


def build_batch(rng, kv_lens, q_lens, num_kv_heads, group, head_dim, dtype, quant=None, scales=(None, None)):
    """Random contexts written into a NaN-filled pool of `dtype` with shuffled blocks; with `quant`
    (float8) they are written quantised with the per-kv-head `scales` (k_scale, v_scale).

    Returns the pools, block tables and per-sequence (q, k, v) in float64: q rounded to `dtype`
    (float32 with `quant`), k and v exactly what the pools hold, dequantised."""
    pages = [-(-n // BLOCK_SIZE) for n in kv_lens]
    num_blocks = sum(pages) + 1 + 3  # null block, plus a few blocks nobody owns
    ids = rng.permutation(np.arange(1, num_blocks))
    width = max(pages)
    tables = np.zeros((len(kv_lens), width), np.int32)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_pool = jnp.full(shape, jnp.nan, dtype)
    v_pool = jnp.full(shape, jnp.nan, dtype)
    seqs, start = [], 0
    for s, (n, p) in enumerate(zip(kv_lens, pages)):
        tables[s, :p] = ids[start : start + p]
        start += p
        k = rng.standard_normal((n, num_kv_heads, head_dim))
        v = rng.standard_normal((n, num_kv_heads, head_dim))
        q = rng.standard_normal((q_lens[s], num_kv_heads * group, head_dim))
        pos = np.arange(n)
        slots = tables[s][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
        slots = jnp.asarray(slots, jnp.int32)
        if quant is None:
            k_pool, v_pool = reference.write_kv(k_pool, v_pool, jnp.asarray(k, dtype), jnp.asarray(v, dtype), slots)
            # Compare against exactly what the pool holds (rounded to dtype).
            seqs.append(tuple(np.asarray(jnp.asarray(x, dtype), np.float64) for x in (q, k, v)))
            continue
        k_pool, v_pool = reference.write_kv(
            k_pool,
            v_pool,
            jnp.asarray(k),
            jnp.asarray(v),
            slots,
            k_scale=scales[0],
            v_scale=scales[1],
            quant_dtype=quant,
        )
        k, v = (np.asarray(pool, np.float64).reshape(-1, num_kv_heads, head_dim)[slots] for pool in (k_pool, v_pool))
        k_scale, v_scale = (np.asarray(x)[:, None] for x in scales)
        seqs.append((np.asarray(q, np.float32).astype(np.float64), k * k_scale, v * v_scale))
    return k_pool, v_pool, tables, seqs


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])  # the live work items only / every item of the bucket
def test_ragged_matches_dense(dtype, tol, group, platform):
    with compiling_for(platform):
        ragged_matches_dense(dtype, tol, group)


def ragged_matches_dense(dtype, tol, group):
    rng = np.random.default_rng(group)
    # decode token, fresh prompt, prefix-cached prompt, chunk ending mid-block, block edges
    kv_lens = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 300, 40, 37]
    q_lens = [1, BLOCK_SIZE - 1, 3, BLOCK_SIZE + 1, 1, 40, 21]
    k_pool, v_pool, tables, seqs = build_batch(rng, kv_lens, q_lens, 2, group, 64, dtype)
    pad_tokens, pad_seqs = 5, 2
    q = np.concatenate([s[0] for s in seqs] + [rng.standard_normal((pad_tokens,) + seqs[0][0].shape[1:])])
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu = np.concatenate([cu, [cu[-1]] * pad_seqs]).astype(np.int32)
    tables = np.concatenate([tables, np.zeros((pad_seqs, tables.shape[1]), np.int32)])
    lens = np.array(kv_lens + [0] * pad_seqs, np.int32)
    out = reference.ragged_paged_attention(
        jnp.asarray(q, dtype),
        k_pool,
        v_pool,
        jnp.asarray(cu),
        jnp.asarray(lens),
        jnp.asarray(tables),
        jnp.int32(len(kv_lens)),
    )
    out = np.asarray(out, np.float64)
    for s, (sq, sk, sv) in enumerate(seqs):
        rows = out[cu[s] : cu[s + 1]]
        expected = dense_attention(sq, sk, sv, np.arange(kv_lens[s] - q_lens[s], kv_lens[s]))
        assert np.isfinite(rows).all(), f"sequence {s}: NaN leaked from an unused page"
        err = np.linalg.norm(rows - expected) / np.linalg.norm(expected)
        assert err < tol, f"sequence {s}: relative error {err:.2e}"
    assert (out[cu[len(kv_lens)] :] == 0).all(), "padding rows must be zero"


def test_ragged_loops_over_live_items_on_a_cpu_and_a_fixed_count_for_a_gpu():
    """On a CPU a step's padding costs nothing (a loop to the live items' count); a GPU program
    must not wait on the host, so there every item of the bucket runs (a fixed trip count)."""
    # each its own shapes: JAX caches traces by shapes, not by the platform they are for
    for platform, data_dependent, tokens in (("cpu", True, 64), ("gpu", False, 32)):
        args = (
            jnp.zeros((tokens, 4, 64)),
            jnp.zeros((9, BLOCK_SIZE, 2, 64)),
            jnp.zeros((9, BLOCK_SIZE, 2, 64)),
            jnp.zeros(9, jnp.int32),
            jnp.zeros(8, jnp.int32),
            jnp.zeros((8, 4), jnp.int32),
            jnp.int32(1),
        )
        with compiling_for(platform):
            text = str(jax.make_jaxpr(reference.ragged_paged_attention)(*args))
        assert ("while[" in text) == data_dependent, platform  # a fixed-count loop traces as a scan


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_decode_matches_dense(dtype, tol):
    rng = np.random.default_rng(7)
    kv_lens = [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1, 300]
    k_pool, v_pool, tables, seqs = build_batch(rng, kv_lens, [1] * len(kv_lens), 2, 4, 128, dtype)
    q = np.concatenate([s[0] for s in seqs])
    out = reference.paged_decode_attention(
        jnp.asarray(q, dtype), k_pool, v_pool, jnp.asarray(tables), jnp.asarray(kv_lens, dtype=jnp.int32)
    )
    out = np.asarray(out, np.float64)
    for b, (sq, sk, sv) in enumerate(seqs):
        expected = dense_attention(sq, sk, sv, [kv_lens[b] - 1])[0]
        err = np.linalg.norm(out[b] - expected) / np.linalg.norm(expected)
        assert err < tol, f"sequence {b}: relative error {err:.2e}"


@pytest.mark.parametrize("window", [1, 7, BLOCK_SIZE, 40])
def test_sliding_windows_match_dense(window):
    """Sliding-window attention (a traced window, as a model's per-layer windows are) equals
    dense attention masked to the window, for decode rows and prompts, across block edges."""
    rng = np.random.default_rng(window)
    kv_lens = [1, BLOCK_SIZE + 1, 300, 40, 37]
    q_lens = [1, 3, 1, 40, 21]
    k_pool, v_pool, tables, seqs = build_batch(rng, kv_lens, q_lens, 2, 4, 64, jnp.float32)
    q = jnp.asarray(np.concatenate([s[0] for s in seqs]), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    lens = jnp.asarray(kv_lens, jnp.int32)
    ragged = jax.jit(reference.ragged_paged_attention)(
        q, k_pool, v_pool, cu, lens, jnp.asarray(tables), jnp.int32(len(kv_lens)), window=jnp.int32(window)
    )
    decode = jax.jit(reference.paged_decode_attention)(
        q[np.asarray(cu[1:]) - 1], k_pool, v_pool, jnp.asarray(tables), lens, window=jnp.int32(window)
    )
    for s, (sq, sk, sv) in enumerate(seqs):
        positions = np.arange(kv_lens[s] - q_lens[s], kv_lens[s])
        expected = dense_attention(sq, sk, sv, positions, window)
        rows = np.asarray(ragged[int(cu[s]) : int(cu[s + 1])], np.float64)
        assert np.linalg.norm(rows - expected) / np.linalg.norm(expected) < 1e-5, f"ragged, sequence {s}"
        last = np.asarray(decode[s], np.float64)
        assert np.linalg.norm(last - expected[-1]) / np.linalg.norm(expected[-1]) < 1e-5, f"decode, sequence {s}"


@pytest.mark.parametrize("storage", ["float8", "float32"])
@pytest.mark.parametrize("quant", [jnp.float8_e4m3fn, jnp.float8_e5m2], ids=["e4m3fn", "e5m2"])
def test_float8_pools_match_dense(quant, storage):
    """K/V written quantised with per-kv-head scales and attended with the same scales equal dense
    attention over the dequantised values, in float8 pools and float8 values held in float32."""
    rng = np.random.default_rng(11)
    scales = jnp.asarray([0.5, 4.0], jnp.float32), jnp.asarray([3.0, 0.25], jnp.float32)
    kv_lens = [1, BLOCK_SIZE - 1, BLOCK_SIZE + 1, 300, 37]
    q_lens = [1, BLOCK_SIZE - 1, 3, 1, 21]
    dtype = quant if storage == "float8" else jnp.float32
    k_pool, v_pool, tables, seqs = build_batch(rng, kv_lens, q_lens, 2, 4, 64, dtype, quant, scales)
    assert k_pool.dtype == dtype and np.isnan(np.asarray(k_pool[0], np.float32)).all(), "null block poisoned"
    q = jnp.asarray(np.concatenate([s[0] for s in seqs]), jnp.float32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    lens, tables = jnp.asarray(kv_lens, jnp.int32), jnp.asarray(tables)
    kw = dict(k_scale=scales[0], v_scale=scales[1])
    out = reference.ragged_paged_attention(q, k_pool, v_pool, jnp.asarray(cu), lens, tables, jnp.int32(5), **kw)
    last = reference.paged_decode_attention(q[cu[1:] - 1], k_pool, v_pool, tables, lens, **kw)
    for s, (sq, sk, sv) in enumerate(seqs):
        expected = dense_attention(sq, sk, sv, np.arange(kv_lens[s] - q_lens[s], kv_lens[s]))
        for got, want in ((np.asarray(out[cu[s] : cu[s + 1]]), expected), (np.asarray(last[s]), expected[-1])):
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert err < 1e-5, f"sequence {s}: relative error {err:.2e}"


def test_write_kv_writes_exactly_the_slots():
    rng = np.random.default_rng(3)
    shape = (6, BLOCK_SIZE, 2, 64)
    k_pool = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    v_pool = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    slots = np.array([5 * BLOCK_SIZE + 3, 2 * BLOCK_SIZE, 1 * BLOCK_SIZE + 15], np.int32)
    k_new = rng.standard_normal((3, 2, 64)).astype(np.float32)
    v_new = rng.standard_normal((3, 2, 64)).astype(np.float32)
    k_out, v_out = reference.write_kv(k_pool, v_pool, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(slots))
    k_expected = np.asarray(k_pool).reshape(-1, 2, 64).copy()
    v_expected = np.asarray(v_pool).reshape(-1, 2, 64).copy()
    k_expected[slots], v_expected[slots] = k_new, v_new
    np.testing.assert_array_equal(np.asarray(k_out).reshape(-1, 2, 64), k_expected)
    np.testing.assert_array_equal(np.asarray(v_out).reshape(-1, 2, 64), v_expected)
