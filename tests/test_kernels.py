"""The Pallas kernels (interpret mode on CPU) equal their jnp references.

Pools start as NaN and only the slots a sequence owns are written, so the null block, pages
nobody owns, the tail of each sequence's last page and every unused block-table entry are NaN:
a stray read anywhere poisons the output. Block tables are shuffled. Shapes stay small because
the Pallas interpreter runs every program one after another on the CPU.
"""

import functools
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.model.grouped_matmul import tile_rows, tile_schedule
from pallas_kernels import (
    decode_attention,
    grouped_matmul,
    paged_decode_attention,
    ragged_paged_attention,
    reference,
    write_kv,
)

BS = 16  # block size
KV_HEADS = 2
TOLERANCE = {jnp.float32: 1e-4, jnp.bfloat16: 1e-2}


def make_pools(rng, kv_lens, width, head_dim, dtype):
    """NaN pools holding random K/V for each sequence on shuffled pages; returns pools, tables."""
    pages = [-(-n // BS) for n in kv_lens]
    num_blocks = sum(pages) + 1 + 3  # the null block and a few blocks nobody owns
    ids = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(kv_lens), width), np.int32)
    shape = (num_blocks, BS, KV_HEADS, head_dim)
    k_pool = np.full(shape, np.nan, np.float32)
    v_pool = np.full(shape, np.nan, np.float32)
    start = 0
    for s, (n, p) in enumerate(zip(kv_lens, pages)):
        tables[s, :p] = ids[start : start + p]
        start += p
        pos = np.arange(n)
        blocks, offsets = tables[s][pos // BS], pos % BS
        k_pool[blocks, offsets] = rng.standard_normal((n, KV_HEADS, head_dim))
        v_pool[blocks, offsets] = rng.standard_normal((n, KV_HEADS, head_dim))
    return jnp.asarray(k_pool, dtype), jnp.asarray(v_pool, dtype), jnp.asarray(tables)


def rel_error(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


# ---------------------------------------------------------------------------------------------
# paged_decode_attention

# Both sides of block boundaries, a long context, and a padding row (length 0).
DECODE_LENS = [1, BS - 1, BS, BS + 1, 300, 0]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_reference(dtype, head_dim, group):
    rng = np.random.default_rng(group * 1000 + head_dim)
    k_pool, v_pool, tables = make_pools(rng, DECODE_LENS, 20, head_dim, dtype)
    q = jnp.asarray(rng.standard_normal((len(DECODE_LENS), KV_HEADS * group, head_dim)), dtype)
    lens = jnp.asarray(DECODE_LENS, jnp.int32)
    out = jax.jit(functools.partial(paged_decode_attention, interpret=True))(q, k_pool, v_pool, tables, lens)
    ref = reference.paged_decode_attention(q, k_pool, v_pool, tables, lens)
    assert out.dtype == q.dtype and out.shape == q.shape
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), "NaN leaked from an unused page"
    assert rel_error(out[:-1], ref[:-1]) < TOLERANCE[dtype]
    assert (out[-1] == 0).all(), "a padding row (seq_len 0) must be zero"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_decode_split_k(dtype):
    """A wide block table (max_model_len >> the actual lengths) gives several splits; the split
    boundaries follow each sequence's actual length, so short rows leave splits empty."""
    lens_list = [1, BS + 1, 300, 700, 0]
    width = 64  # 1,024 tokens per sequence at most
    assert decode_attention.num_splits(len(lens_list), KV_HEADS, width, BS, 128) == 4
    rng = np.random.default_rng(11)
    k_pool, v_pool, tables = make_pools(rng, lens_list, width, 128, dtype)
    q = jnp.asarray(rng.standard_normal((len(lens_list), KV_HEADS * 4, 128)), dtype)
    lens = jnp.asarray(lens_list, jnp.int32)
    out = paged_decode_attention(q, k_pool, v_pool, tables, lens, interpret=True)
    ref = reference.paged_decode_attention(q, k_pool, v_pool, tables, lens)
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    assert rel_error(out[:-1], ref[:-1]) < TOLERANCE[dtype]
    assert (out[-1] == 0).all()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_decode_visits_longest_first_with_the_same_results(dtype):
    """The grid's longest-first order is a permutation: every row equal, bit for bit, to the
    batch-order run, and to the reference (lengths unsorted, tied, and a padding row first)."""
    lens_list = [0, 5, 300, 40, 300, 17, 129, 1]
    rng = np.random.default_rng(21)
    k_pool, v_pool, tables = make_pools(rng, lens_list, 20, 64, dtype)
    q = jnp.asarray(rng.standard_normal((len(lens_list), KV_HEADS * 4, 64)), dtype)
    lens = jnp.asarray(lens_list, jnp.int32)
    order = decode_attention._visit_order(lens, True)
    assert order.tolist() == [2, 4, 6, 3, 5, 1, 7, 0]  # longest first, ties in batch order
    sorted_out = paged_decode_attention(q, k_pool, v_pool, tables, lens, interpret=True)
    batch_out = paged_decode_attention(q, k_pool, v_pool, tables, lens, interpret=True, longest_first=False)
    np.testing.assert_array_equal(np.asarray(sorted_out), np.asarray(batch_out))
    ref = reference.paged_decode_attention(q, k_pool, v_pool, tables, lens)
    out = np.asarray(sorted_out, np.float64)
    assert np.isfinite(out).all() and (out[0] == 0).all()
    assert rel_error(out[1:], ref[1:]) < TOLERANCE[dtype]


def test_every_attention_backend_option_is_a_registered_implementation_of_the_references_signatures():
    """`attention_backend`'s choices (read without JAX) are the registry's names plus "auto";
    each implementation takes every argument its reference takes."""
    from jaxpaged.config.attention import ATTENTION_BACKENDS
    from jaxpaged.model.attention import BACKENDS

    assert set(BACKENDS) == set(ATTENTION_BACKENDS) - {"auto"}
    for backend in BACKENDS.values():
        for name in ("paged_decode_attention", "ragged_paged_attention"):
            wanted = inspect.signature(getattr(reference, name)).parameters
            assert set(wanted) <= set(inspect.signature(getattr(backend, name)).parameters), (backend.name, name)


def test_decode_scale_and_default_interpret():
    """`scale` is honoured; `interpret=None` interprets on a CPU backend."""
    rng = np.random.default_rng(5)
    k_pool, v_pool, tables = make_pools(rng, [40, 7], 4, 64, jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, KV_HEADS * 2, 64)), jnp.float32)
    lens = jnp.asarray([40, 7], jnp.int32)
    out = paged_decode_attention(q, k_pool, v_pool, tables, lens, scale=0.3)
    ref = reference.paged_decode_attention(q, k_pool, v_pool, tables, lens, scale=0.3)
    assert rel_error(out, ref) < TOLERANCE[jnp.float32]


def test_num_splits_fills_the_gpu_for_small_batches():
    # Llama-3.1-8B decode (8 kv heads, head_dim 128), 8K-token tables.
    assert decode_attention.num_splits(1, 8, 512, 16, 128) == 32
    assert decode_attention.num_splits(8, 8, 512, 16, 128) == 8
    assert decode_attention.num_splits(64, 8, 512, 16, 128) == 1
    assert decode_attention.num_splits(1, 8, 4, 16, 128) == 1  # a one-tile table cannot split


# ---------------------------------------------------------------------------------------------
# ragged_paged_attention

# (kv_len, q_len): decode tokens (one on a block edge, one after a long context), fresh prompts
# on both sides of a block, a long fresh prompt, prefix-cached prompts, chunks ending mid-block.
RAGGED = [
    (1, 1),
    (BS + 1, 1),
    (300, 1),
    (BS - 1, BS - 1),
    (BS, BS),
    (BS + 1, BS + 1),
    (120, 120),
    (BS + 1, 3),
    (37, 21),
    (150, 64),
]
PAD_TOKENS, PAD_SEQS = 5, 2


def ragged_inputs(rng, seqs, group, head_dim, dtype):
    kv_lens, q_lens = zip(*seqs)
    k_pool, v_pool, tables = make_pools(rng, kv_lens, 24, head_dim, dtype)
    num_tokens = sum(q_lens) + PAD_TOKENS
    q = jnp.asarray(rng.standard_normal((num_tokens, KV_HEADS * group, head_dim)), dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens), [sum(q_lens)] * PAD_SEQS]).astype(np.int32)
    lens = np.array(list(kv_lens) + [0] * PAD_SEQS, np.int32)
    tables = jnp.concatenate([tables, jnp.zeros((PAD_SEQS, tables.shape[1]), jnp.int32)])
    return q, k_pool, v_pool, jnp.asarray(cu), jnp.asarray(lens), tables, jnp.int32(len(seqs))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_ragged_matches_reference(dtype, head_dim, group):
    rng = np.random.default_rng(group * 1000 + head_dim + 1)
    args = ragged_inputs(rng, RAGGED, group, head_dim, dtype)
    out = jax.jit(functools.partial(ragged_paged_attention, interpret=True))(*args)
    ref = np.asarray(reference.ragged_paged_attention(*args), np.float64)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    out = np.asarray(out, np.float64)
    real = sum(q for _, q in RAGGED)
    assert np.isfinite(out).all(), "NaN leaked from an unused page"
    assert rel_error(out[:real], ref[:real]) < TOLERANCE[dtype]
    cu = np.asarray(args[3])
    for s in range(len(RAGGED)):  # every sequence on its own, so a small one cannot hide
        rows = slice(cu[s], cu[s + 1])
        assert rel_error(out[rows], ref[rows]) < TOLERANCE[dtype], f"sequence {s} {RAGGED[s]}"
    assert (out[real:] == 0).all(), "padding rows must be zero"


def poison_before_windows(pool, tables, seqs, window):
    """`pool` with NaN in every position before each sequence's first query's window: keys no
    query of the step may read (a cache that frees pages outside the window would reuse them)."""
    pool = np.array(pool, np.float32)
    for s, (kv_len, q_len) in enumerate(seqs):
        pos = np.arange(max(0, kv_len - q_len - window + 1))
        pool[np.asarray(tables)[s][pos // BS], pos % BS] = np.nan
    return jnp.asarray(pool, pool.dtype)


@pytest.mark.parametrize("window", [1, 7, 40])
@pytest.mark.parametrize("kernel", ["decode", "ragged", "mixed"])
def test_sliding_windows_match_reference(kernel, window):
    """Both kernels and the mixed step under a sliding window (traced, as a model's per-layer
    windows are) equal the reference, never reading a key before the window (NaN there)."""
    import pallas_kernels
    from jaxpaged.model.metadata import AttentionMetadata
    from jaxpaged.model.mixed_attention import mixed_paged_attention

    rng = np.random.default_rng(window)
    seqs = [(n, 1) for n in DECODE_LENS[:-1]] if kernel == "decode" else MIXED
    q, k_pool, v_pool, cu, lens, tables, num_seqs = ragged_inputs(rng, seqs, 4, 64, jnp.float32)
    k_pool, v_pool = (poison_before_windows(p, tables, seqs, window) for p in (k_pool, v_pool))
    w = jnp.int32(window)
    ref = reference.ragged_paged_attention(q, k_pool, v_pool, cu, lens, tables, num_seqs, window=w)
    if kernel == "decode":
        out = jax.jit(paged_decode_attention)(
            q[: len(seqs)], k_pool, v_pool, tables[: len(seqs)], lens[: len(seqs)], window=w
        )
        ref = ref[: len(seqs)]
    elif kernel == "ragged":
        out = jax.jit(ragged_paged_attention)(q, k_pool, v_pool, cu, lens, tables, num_seqs, window=w)
    else:
        meta = AttentionMetadata(
            jnp.zeros(q.shape[0], jnp.int32), jnp.zeros(q.shape[0], jnp.int32), cu, lens, tables, num_seqs
        )
        out = jax.jit(functools.partial(mixed_paged_attention, pallas_kernels))(q, k_pool, v_pool, meta, window=w)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    real = min(len(out), int(cu[len(seqs)]))
    assert np.isfinite(out).all() and np.isfinite(ref).all(), "a key before the window was read"
    for s in range(len(seqs)):
        rows = slice(int(cu[s]), int(cu[s + 1])) if kernel != "decode" else slice(s, s + 1)
        assert rel_error(out[rows], ref[rows]) < TOLERANCE[jnp.float32], f"sequence {s} {seqs[s]}"
    assert (out[real:] == 0).all()


def test_ragged_all_decode_and_scale():
    """A pure-decode batch (one token per sequence), custom scale, interpret=None on CPU."""
    rng = np.random.default_rng(9)
    seqs = [(n, 1) for n in (1, BS - 1, BS, BS + 1, 200)]
    args = ragged_inputs(rng, seqs, 4, 64, jnp.float32)
    out = ragged_paged_attention(*args, scale=0.2)
    ref = reference.ragged_paged_attention(*args, scale=0.2)
    assert rel_error(out[: len(seqs)], ref[: len(seqs)]) < TOLERANCE[jnp.float32]
    assert (np.asarray(out[len(seqs) :]) == 0).all()


def test_ragged_no_sequences():
    """num_seqs = 0 (an all-padding step): everything is zero, nothing is read."""
    rng = np.random.default_rng(4)
    q, k_pool, v_pool, cu, lens, tables, _ = ragged_inputs(rng, RAGGED[:3], 1, 64, jnp.float32)
    out = ragged_paged_attention(q, k_pool, v_pool, cu, lens, tables, jnp.int32(0), interpret=True)
    assert (np.asarray(out) == 0).all()


def test_float32_queries_over_bfloat16_pools():
    """The dots compute in the promoted dtype (float32 here); the output keeps the query dtype."""
    rng = np.random.default_rng(8)
    seqs = [(BS + 1, 1), (40, 40), (37, 21)]
    q, *rest = ragged_inputs(rng, seqs, 4, 64, jnp.bfloat16)
    q = q.astype(jnp.float32)
    out = ragged_paged_attention(q, *rest, interpret=True)
    ref = reference.ragged_paged_attention(q, *rest)
    assert out.dtype == jnp.float32
    assert rel_error(out, ref) < TOLERANCE[jnp.bfloat16]
    k_pool, v_pool, cu, lens, tables = rest[0], rest[1], rest[2], rest[3], rest[4]
    dq = q[np.asarray(cu[1:4]) - 1]  # each sequence's last token, as a decode batch
    out = paged_decode_attention(dq, k_pool, v_pool, tables[:3], lens[:3], interpret=True)
    assert out.dtype == jnp.float32
    assert rel_error(out, reference.paged_decode_attention(dq, k_pool, v_pool, tables[:3], lens[:3])) < 1e-2


# ---------------------------------------------------------------------------------------------
# float8 pools (a quantised KV cache): per-kv-head scales, NaN-poisoned like the others

FLOAT8 = {"e4m3fn": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
K_SCALE = jnp.asarray([0.5, 4.0], jnp.float32)  # one per kv head, different per head
V_SCALE = jnp.asarray([3.0, 0.25], jnp.float32)
RAGGED_FP8 = [(1, 1), (BS + 1, 1), (BS, BS), (37, 21), (150, 64)]


def quantised(pool, quant, storage):
    """The NaN-poisoned float32 `pool` rounded to `quant`, stored in float8 itself or in float32
    (the CPU engine's storage). Poison stays NaN and no value overflows."""
    stored = pool.astype(quant)
    stored = stored if storage == "float8" else stored.astype(jnp.float32)
    assert (np.isnan(np.asarray(stored, np.float32)) == np.isnan(np.asarray(pool))).all()
    return stored


def dequantised(pool, scale):
    return pool.astype(jnp.float32) * scale[:, None]


@pytest.mark.parametrize("storage", ["float8", "float32"])
@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16], ids=["q-f32", "q-bf16"])
@pytest.mark.parametrize("quant", list(FLOAT8.values()), ids=list(FLOAT8))
@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_float8_pools_match_reference(kernel, quant, q_dtype, storage):
    """Kernel == reference over float8 pools with per-head scales, and the reference with scales
    == the reference over the explicitly dequantised float32 pools.

    Both read the same float8 values, exact in q's dtype, so the kernel's error budget is that of
    an unquantised pool of q's dtype (`TOLERANCE`): the bfloat16 cast of the probabilities and
    of the output. The decode table is wide enough for 4 splits (v_scale across the combine).
    """
    rng = np.random.default_rng(len(kernel) + 10 * quant.dtype.itemsize + (storage == "float8"))
    if kernel == "decode":
        k_pool, v_pool, tables = make_pools(rng, DECODE_LENS, 64, 64, jnp.float32)
        assert decode_attention.num_splits(len(DECODE_LENS), KV_HEADS, 64, BS, 64) == 4
        q = jnp.asarray(rng.standard_normal((len(DECODE_LENS), KV_HEADS * 4, 64)), q_dtype)
        rest = (tables, jnp.asarray(DECODE_LENS, jnp.int32))
        fn, ref_fn, real = paged_decode_attention, reference.paged_decode_attention, len(DECODE_LENS) - 1
    else:
        q, k_pool, v_pool, *rest = ragged_inputs(rng, RAGGED_FP8, 2, 64, jnp.float32)
        q = q.astype(q_dtype)
        fn, ref_fn, real = ragged_paged_attention, reference.ragged_paged_attention, sum(n for _, n in RAGGED_FP8)
    k_pool, v_pool = quantised(k_pool, quant, storage), quantised(v_pool, quant, storage)
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    out = jax.jit(functools.partial(fn, interpret=True, **scales))(q, k_pool, v_pool, *rest)
    ref = ref_fn(q, k_pool, v_pool, *rest, **scales)
    explicit = ref_fn(q, dequantised(k_pool, K_SCALE), dequantised(v_pool, V_SCALE), *rest)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert rel_error(ref[:real], explicit[:real]) < 1e-6
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), "NaN leaked from an unused page"
    assert rel_error(out[:real], ref[:real]) < TOLERANCE[q_dtype]
    assert (out[real:] == 0).all(), "padding rows must be zero"


@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_unsupported_head_dim_is_a_clear_error(kernel):
    shape = (4, BS, KV_HEADS, 96)
    pool = jnp.ones(shape, jnp.float32)
    q = jnp.ones((3, KV_HEADS, 96), jnp.float32)
    table = jnp.zeros((3, 2), jnp.int32)
    with pytest.raises(ValueError, match="head_dim=96"):
        if kernel == "decode":
            paged_decode_attention(q, pool, pool, table, jnp.ones(3, jnp.int32))
        else:
            cu = jnp.arange(4, dtype=jnp.int32)
            ragged_paged_attention(q, pool, pool, cu, jnp.ones(3, jnp.int32), table, jnp.int32(3))


# ---------------------------------------------------------------------------------------------
# tiles= (the tuning hook of benchmarks/gpu/attention_sweep.py): other tiles, same results


@pytest.mark.parametrize("tiles", [(16, 16, 2, 3), (64, 32, 4, 1)], ids=["4-tokens-16-keys", "16-tokens-32-keys"])
def test_ragged_tiles_override_matches_the_default(tiles):
    """Other row and key tiles move every block and tile edge (4 tokens x 4 heads per program, or
    16 tokens over 32-key tiles) over uneven lengths, NaN in unowned slots and padding: the
    results stay the default tiles' (and the reference's) up to f32 rounding."""
    rng = np.random.default_rng(21)
    args = ragged_inputs(rng, RAGGED, 4, 64, jnp.float32)
    default = np.asarray(jax.jit(functools.partial(ragged_paged_attention, interpret=True))(*args), np.float64)
    out = jax.jit(functools.partial(ragged_paged_attention, interpret=True, tiles=tiles))(*args)
    out, real = np.asarray(out, np.float64), sum(q for _, q in RAGGED)
    assert np.isfinite(out).all(), "NaN leaked from an unused page"
    assert rel_error(out[:real], default[:real]) < 1e-5
    assert rel_error(out[:real], reference.ragged_paged_attention(*args)[:real]) < TOLERANCE[jnp.float32]
    assert (out[real:] == 0).all(), "padding rows must be zero"


def test_decode_tiles_override_matches_the_default():
    """32-key tiles give the default tiles' results; they also make four splits instead of one (the
    split count follows block_k), so the splits' combine is covered too."""
    rng = np.random.default_rng(22)
    k_pool, v_pool, tables = make_pools(rng, DECODE_LENS, 20, 64, jnp.float32)
    q = jnp.asarray(rng.standard_normal((len(DECODE_LENS), KV_HEADS * 4, 64)), jnp.float32)
    args = (q, k_pool, v_pool, tables, jnp.asarray(DECODE_LENS, jnp.int32))
    default = np.asarray(paged_decode_attention(*args, interpret=True), np.float64)
    assert decode_attention.num_splits(len(DECODE_LENS), KV_HEADS, 20, BS, 64, block_k=32) == 4
    out = np.asarray(paged_decode_attention(*args, interpret=True, tiles=(32, 2, 3)), np.float64)
    assert np.isfinite(out).all() and (out[-1] == 0).all()
    assert rel_error(out, default) < 1e-5


@pytest.mark.parametrize(
    "kernel,tiles,message",
    [
        ("ragged", (100, 64, 8, 2), "rows=100 must be a power of two"),
        ("ragged", (8, 64, 8, 2), "rows=8 must be an int >= 16"),
        ("ragged", (16, 64, 8, 2), "rows=16 must be an int >= 32"),  # a group of 32 heads
        ("ragged", (128, 8, 8, 2), "block_k=8 must be an int >= 16"),
        ("ragged", (128, 64, 6, 2), "num_warps=6 must be a power of two"),
        ("ragged", (128, 64, 8, 0), "num_stages=0 must be an int >= 1"),
        ("ragged", (128, 64, 8), "expected 4 values"),
        ("decode", (96, 4, 2), "block_k=96 must be a power of two"),
        ("decode", (128, 4, 2, 2), "expected 3 values"),
    ],
)
def test_invalid_tiles_are_a_clear_error(kernel, tiles, message):
    group = 32 if "32" in message else 4
    pool = jnp.ones((4, BS, KV_HEADS, 64), jnp.float32)
    q = jnp.ones((3, KV_HEADS * group, 64), jnp.float32)
    table = jnp.zeros((3, 2), jnp.int32)
    with pytest.raises(ValueError, match=re.escape(message)):
        if kernel == "decode":
            paged_decode_attention(q, pool, pool, table, jnp.ones(3, jnp.int32), tiles=tiles)
        else:
            cu = jnp.arange(4, dtype=jnp.int32)
            ragged_paged_attention(q, pool, pool, cu, jnp.ones(3, jnp.int32), table, jnp.int32(3), tiles=tiles)


# ---------------------------------------------------------------------------------------------
# write_kv


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_write_kv_writes_exactly_the_slots(dtype):
    rng = np.random.default_rng(3)
    shape = (6, BS, KV_HEADS, 64)
    k_pool = jnp.asarray(rng.standard_normal(shape), dtype)
    v_pool = jnp.asarray(rng.standard_normal(shape), dtype)
    # Real tokens, then two padding tokens aimed at the null block.
    slots = np.array([5 * BS + 3, 2 * BS, 1 * BS + 15, 3 * BS + 1, 0, 0], np.int32)
    k_new = rng.standard_normal((len(slots), KV_HEADS, 64)).astype(np.float32)
    v_new = rng.standard_normal((len(slots), KV_HEADS, 64)).astype(np.float32)
    k_out, v_out = jax.jit(write_kv)(k_pool, v_pool, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(slots))
    assert k_out.dtype == dtype and k_out.shape == shape
    for pool, new, out in ((k_pool, k_new, k_out), (v_pool, v_new, v_out)):
        expected = np.asarray(pool, np.float32).reshape(-1, KV_HEADS, 64).copy()
        expected[slots[:4]] = np.asarray(jnp.asarray(new[:4], dtype), np.float32)
        got = np.asarray(out, np.float32).reshape(-1, KV_HEADS, 64)
        # Block 0 (the null block) takes the padding writes: its contents are unspecified.
        np.testing.assert_array_equal(got[BS:], expected[BS:])


# pool storage dtype, quant_dtype. XLA's CPU backend converts the whole operand of a float8 scatter
# to float32, and of a bfloat16 one up to jax 0.10 (jax 0.11.2 scatters bfloat16 natively), so
# jaxpaged.model.kv_pool stores such pools in float32 on CPU: there the update still aliases the
# pool, but its temporaries grow with the pool. Those cases are expected to fail exactly there
# (strict: a JAX that fixes it turns them red, to be re-marked); everywhere else they must pass.
_ON_CPU = jax.default_backend() == "cpu"
_OLD_JAX = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11)
_CPU_UPCASTS_FLOAT8 = pytest.mark.xfail(_ON_CPU, reason="XLA:CPU converts a float8 scatter operand to f32", strict=True)
_CPU_UPCASTS_BF16 = pytest.mark.xfail(
    _ON_CPU and _OLD_JAX, reason="XLA:CPU of jax < 0.11 converts a bf16 scatter operand to f32", strict=True
)
IN_PLACE = [
    pytest.param(jnp.float32, None, id="f32"),
    pytest.param(jnp.float32, jnp.float8_e4m3fn, id="e4m3fn-values-in-f32"),
    pytest.param(jnp.bfloat16, None, id="bf16", marks=_CPU_UPCASTS_BF16),
    pytest.param(jnp.float8_e4m3fn, jnp.float8_e4m3fn, id="e4m3fn", marks=_CPU_UPCASTS_FLOAT8),
]


@pytest.mark.parametrize("storage,quant", IN_PLACE)
def test_write_kv_updates_donated_pools_in_place(storage, quant):
    """The donated pools are updated in place, and the temporaries do not grow with the pool."""
    step = jax.jit(functools.partial(write_kv, quant_dtype=quant), donate_argnums=(0, 1))
    new = jnp.ones((8, KV_HEADS, 64), jnp.float32)
    slots = jnp.arange(8, dtype=jnp.int32) * 5
    temps = []
    for num_blocks in (256, 1024):  # 2 and 8 MiB per float32 pool
        shape = (num_blocks, BS, KV_HEADS, 64)
        pool_bytes = int(np.prod(shape)) * jnp.dtype(storage).itemsize
        k_pool, v_pool = jnp.ones(shape, storage), jnp.ones(shape, storage)
        stats = step.lower(k_pool, v_pool, new, new, slots).compile().memory_analysis()
        assert stats.alias_size_in_bytes >= 2 * pool_bytes, stats
        k_ptr = k_pool.unsafe_buffer_pointer()
        k_out, _ = step(k_pool, v_pool, new, new, slots)
        assert k_pool.is_deleted()
        assert k_out.unsafe_buffer_pointer() == k_ptr, "the K pool was copied instead of updated"
        temps.append(stats.temp_size_in_bytes)
    assert temps[0] == temps[1] and temps[0] < pool_bytes // 64, temps


@pytest.mark.parametrize("storage", ["float8", "float32"])
@pytest.mark.parametrize("quant", list(FLOAT8.values()), ids=list(FLOAT8))
def test_write_kv_quantises_to_float8(quant, storage):
    """Each row lands at exactly its slot as saturate(x / scale[kv head]) rounded to float8;
    out-of-range values saturate to +-max (never NaN or inf); other slots are untouched."""
    rng = np.random.default_rng(13)
    shape = (6, BS, KV_HEADS, 64)
    pool_dtype = quant if storage == "float8" else jnp.float32
    k_pool = jnp.asarray(rng.standard_normal(shape), quant).astype(pool_dtype)
    v_pool = jnp.asarray(rng.standard_normal(shape), quant).astype(pool_dtype)
    slots = np.array([5 * BS + 3, 2 * BS, 1 * BS + 15, 3 * BS + 1, 0, 0], np.int32)
    k_scale, v_scale = np.float32([0.3, 3.7]), np.float32([1.9, 0.07])
    limit = float(jnp.finfo(quant).max)
    k_new = (rng.standard_normal((len(slots), KV_HEADS, 64)) * 50).astype(np.float32)
    v_new = (rng.standard_normal((len(slots), KV_HEADS, 64)) * 50).astype(np.float32)
    k_new[0, 0, :4] = [1e30, -1e30, 2 * limit * k_scale[0], np.inf]  # saturate
    v_new[1, 1, :2] = [limit * v_scale[1] * 1.01, -1e9]
    step = jax.jit(functools.partial(write_kv, quant_dtype=quant))
    k_out, v_out = step(k_pool, v_pool, k_new, v_new, slots, k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale))
    assert k_out.dtype == pool_dtype
    for pool, new, scale, out in ((k_pool, k_new, k_scale, k_out), (v_pool, v_new, v_scale, v_out)):
        stored = np.clip(new / scale[:, None], -limit, limit).astype(quant.dtype).astype(np.float32)
        expected = np.asarray(pool, np.float32).reshape(-1, KV_HEADS, 64).copy()
        expected[slots[:4]] = stored[:4]
        got = np.asarray(out, np.float32).reshape(-1, KV_HEADS, 64)
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got[BS:], expected[BS:])  # block 0 takes the padding writes
    assert (np.asarray(k_out, np.float32)[5, 3, 0, :4] == [limit, -limit, limit, limit]).all()
    assert (np.asarray(v_out, np.float32)[2, 0, 1, :2] == [limit, -limit]).all()


@pytest.mark.parametrize("quant", list(FLOAT8.values()), ids=list(FLOAT8))
def test_write_kv_float8_without_scales_is_scale_one(quant):
    rng = np.random.default_rng(14)
    pool = jnp.zeros((4, BS, KV_HEADS, 64), quant)
    new = jnp.asarray(rng.standard_normal((3, KV_HEADS, 64)) * 100, jnp.float32)
    slots = jnp.asarray([BS, 2 * BS + 5, 3 * BS + 15], jnp.int32)
    unscaled = write_kv(pool, pool, new, new, slots, quant_dtype=quant)
    ones = jnp.ones((KV_HEADS,), jnp.float32)
    scaled = write_kv(pool, pool, new, new, slots, k_scale=ones, v_scale=ones, quant_dtype=quant)
    for a, b in zip(unscaled, scaled):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    limit = float(jnp.finfo(quant).max)
    expected = np.clip(np.asarray(new), -limit, limit).astype(quant.dtype).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(unscaled[0], np.float32).reshape(-1, KV_HEADS, 64)[slots], expected)


def test_write_kv_rejects_scales_without_a_float8_dtype():
    pool = jnp.zeros((2, BS, KV_HEADS, 64), jnp.float32)
    new, slots, scale = jnp.ones((1, KV_HEADS, 64)), jnp.zeros((1,), jnp.int32), jnp.ones((KV_HEADS,))
    with pytest.raises(ValueError, match="need a quant_dtype"):
        write_kv(pool, pool, new, new, slots, k_scale=scale)
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2"):
        write_kv(pool, pool, new, new, slots, quant_dtype=jnp.bfloat16)


# ---------------------------------------------------------------------------------------------
# grouped_matmul (a mixture of experts' FFN)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("num_rows", "num_experts"), [(6, 8), (96, 4)], ids=["decode-1-row-tiles", "16-row-tiles"])
def test_grouped_matmul_matches_numpy_for_any_routing(dtype, num_rows, num_experts):
    """Each row times its own expert's weight, for routings that leave experts empty, give one
    expert every row, or fill the last experts only (the spare tiles, which run last, point at
    row 0 and the last expert: one that wrote would show)."""
    rng = np.random.default_rng(num_rows)
    rows = jnp.asarray(rng.standard_normal((num_rows, 128)), dtype)
    weight = jnp.asarray(rng.standard_normal((num_experts, 128, 256)), dtype)
    tile = tile_rows(num_rows, num_experts)

    @jax.jit
    def kernel(rows, weight, sizes):
        return grouped_matmul(rows, weight, *tile_schedule(sizes, num_rows, tile), tile, interpret=True)

    share = rng.dirichlet(np.ones(num_experts))
    routings = {
        "random": rng.multinomial(num_rows, share),
        "one expert": np.eye(num_experts, dtype=int)[1] * num_rows,
        "last experts": np.r_[np.zeros(num_experts - 2, int), num_rows // 2, num_rows - num_rows // 2],
    }
    for name, sizes in routings.items():
        owner = np.repeat(np.arange(num_experts), sizes)
        expected = np.einsum("mi,mio->mo", np.asarray(rows, np.float32), np.asarray(weight, np.float32)[owner])
        out = kernel(rows, weight, jnp.asarray(sizes, jnp.int32))
        assert out.dtype == dtype and rel_error(out, expected) < TOLERANCE[dtype], name


def test_grouped_matmul_refuses_widths_it_does_not_tile():
    rows, weight = jnp.zeros((4, 96)), jnp.zeros((2, 96, 128))
    with pytest.raises(ValueError, match=r"multiples of 64 .* not \[96, 128\]"):
        grouped_matmul(rows, weight, *tile_schedule(jnp.asarray([4, 0]), 4, 1), 1, interpret=True)


# ---------------------------------------------------------------------------------------------
# a mixed step: its leading decode rows on the decode kernel, the rest on the ragged kernel

# (kv_len, q_len): decodes first (one on a block edge, one long), a one-token prefill chunk among
# them, then prefill chunks and fresh prompts; a step whose front is a prefill has no decode rows.
MIXED = [(BS + 1, 1), (300, 1), (1, 1), (BS, 1), (37, 21), (BS + 1, BS + 1), (150, 64), (2, 1)]
NO_LEADING_DECODES = [(37, 21), (BS + 1, 1), (300, 1)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("seqs", [MIXED, NO_LEADING_DECODES], ids=["decodes-first", "prefill-first"])
def test_mixed_step_on_both_kernels_matches_the_ragged_reference(dtype, group, seqs):
    """`mixed_paged_attention` over the Pallas kernels (interpret mode) equals the ragged
    reference on every sequence, NaN-poisoned pages never read, padding rows zero."""
    import pallas_kernels
    from jaxpaged.model.metadata import AttentionMetadata
    from jaxpaged.model.mixed_attention import leading_decode_rows, mixed_paged_attention

    rng = np.random.default_rng(group * 7 + len(seqs))
    q, k_pool, v_pool, cu, lens, tables, num_seqs = ragged_inputs(rng, seqs, group, 128, dtype)
    meta = AttentionMetadata(
        jnp.zeros(q.shape[0], jnp.int32), jnp.zeros(q.shape[0], jnp.int32), cu, lens, tables, num_seqs
    )
    assert int(leading_decode_rows(cu, num_seqs)) == (4 if seqs is MIXED else 0)
    out = jax.jit(functools.partial(mixed_paged_attention, pallas_kernels))(q, k_pool, v_pool, meta)
    ref = np.asarray(reference.ragged_paged_attention(q, k_pool, v_pool, cu, lens, tables, num_seqs), np.float64)
    out = np.asarray(out, np.float64)
    assert out.shape == q.shape and np.isfinite(out).all(), "NaN leaked from an unused page"
    for s in range(len(seqs)):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        assert rel_error(out[rows], ref[rows]) < TOLERANCE[dtype], f"sequence {s} {seqs[s]}"
    assert (out[int(cu[len(seqs)]) :] == 0).all(), "padding rows must be zero"


def test_mixed_step_over_float8_pools_matches_the_ragged_reference():
    """Both kernels of a mixed step dequantise with the pool's per-head scales."""
    import pallas_kernels
    from jaxpaged.model.metadata import AttentionMetadata
    from jaxpaged.model.mixed_attention import mixed_paged_attention

    rng = np.random.default_rng(5)
    q, k_pool, v_pool, cu, lens, tables, num_seqs = ragged_inputs(rng, MIXED, 4, 64, jnp.float32)
    k_pool, v_pool = quantised(k_pool, jnp.float8_e4m3fn, "float8"), quantised(v_pool, jnp.float8_e4m3fn, "float8")
    meta = AttentionMetadata(
        jnp.zeros(q.shape[0], jnp.int32), jnp.zeros(q.shape[0], jnp.int32), cu, lens, tables, num_seqs
    )
    scales = dict(k_scale=K_SCALE, v_scale=V_SCALE)
    out = jax.jit(functools.partial(mixed_paged_attention, pallas_kernels, **scales))(q, k_pool, v_pool, meta)
    ref = reference.ragged_paged_attention(q, k_pool, v_pool, cu, lens, tables, num_seqs, **scales)
    real = int(cu[len(MIXED)])
    assert np.isfinite(np.asarray(out)).all() and rel_error(out[:real], ref[:real]) < TOLERANCE[jnp.float32]
