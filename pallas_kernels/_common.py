"""Helpers shared by the Pallas Triton kernels: backend choice, compiler params, shape and dtype
rules, the online-softmax step.

Everything version-dependent about the Pallas Triton backend lives here, so a kernel file only
says what it computes. Checked against jax 0.10.2 and 0.11.2.
"""

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl  # noqa: F401 (the kernels use it as `c.pl`)

# The Triton backend's `CompilerParams`, `load` and `store` live in `jax.experimental.pallas.triton`
# in every JAX we support (0.10.2 and 0.11.2 checked; upstream deprecates the backend in 0.11).
try:
    from jax.experimental.pallas import triton as plgpu
except ImportError as e:  # pragma: no cover - a JAX without the Pallas Triton backend
    raise ImportError(
        f"pallas_kernels needs jax.experimental.pallas.triton (jax {jax.__version__} has none); "
        "pallas_kernels.reference holds the pure-jnp path"
    ) from e

from pallas_kernels.platform import target_platform
from pallas_kernels.reference import FLOAT8_DTYPES, MASK_VALUE, NO_WINDOW

SUPPORTED_HEAD_DIMS = (64, 128, 256)
LOG2E = math.log2(math.e)

load = plgpu.load
store = plgpu.store


def compiler_params(num_warps: int, num_stages: int):
    """Triton compiler params, always passed explicitly so the backend never depends on defaults."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_tiles(kernel: str, tiles, minimums: dict[str, int]) -> tuple[int, ...]:
    """Validates a kernel's tile override (its tuning hook); returns it as a tuple of ints.

    `minimums` names the entries in order, each with its least value; every entry is an int, and
    every one but `num_stages` (any count of pipeline stages) a power of two: Triton tensor sizes
    and warp counts must be.

    Raises:
      ValueError: naming the kernel, the entry, its value and what is allowed.
    """
    tiles = tuple(tiles)
    spelled = f"{kernel}(tiles={tiles})"
    if len(tiles) != len(minimums):
        raise ValueError(f"{spelled}: expected {len(minimums)} values ({', '.join(minimums)})")
    for (name, least), value in zip(minimums.items(), tiles):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{spelled}: {name}={value!r} must be an int >= {least}")
        if name != "num_stages" and value & (value - 1):
            raise ValueError(f"{spelled}: {name}={value} must be a power of two")
    return tiles


def resolve_interpret(interpret: bool | None) -> bool:
    """`None` means: run the real kernel on GPU, interpret it anywhere else (CPU tests); see
    `target_platform`."""
    if interpret is None:
        return target_platform() != "gpu"
    return bool(interpret)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton tensors must have power-of-two sizes)."""
    return 1 << max(0, int(n) - 1).bit_length()


def compute_dtype(q_dtype, pool_dtype) -> jnp.dtype:
    """The dtype both operands of the kernels' dots are cast to: q's and the pool's, promoted.

    A float8 pool computes in q's dtype (its values are exact in bfloat16, float16 and float32):
    JAX refuses to promote 8-bit floats implicitly, and casting q to float8 would quantise it.
    """
    if jnp.dtype(pool_dtype) in FLOAT8_DTYPES:
        return jnp.dtype(q_dtype)
    return jnp.promote_types(q_dtype, pool_dtype)


def kv_scales(k_scale, v_scale, num_kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """The `[K]` float32 dequantisation scales the kernels load per kv head (None: ones)."""
    ones = jnp.ones((num_kv_heads,), jnp.float32)
    k_scale = ones if k_scale is None else jnp.asarray(k_scale, jnp.float32).reshape(num_kv_heads)
    v_scale = ones if v_scale is None else jnp.asarray(v_scale, jnp.float32).reshape(num_kv_heads)
    return k_scale, v_scale


def window_array(window) -> jax.Array:
    """A kernel's sliding window as its `[1]` int32 input (`NO_WINDOW` for None): a query at
    position p sees the keys at positions > p - window."""
    return jnp.full((1,), NO_WINDOW if window is None else window, jnp.int32)


def check_shapes(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array) -> tuple[int, int, int]:
    """Validates head layout; returns (num_kv_heads K, group G = N // K, head_dim H).

    Raises:
      ValueError: unsupported head_dim, mismatched pools (shape or dtype), or N not a multiple of K.
    """
    num_heads, head_dim = q.shape[-2:]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim={head_dim} is not supported by the Pallas kernels (supported: "
            f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}); use pallas_kernels.reference instead."
        )
    if k_pool.shape != v_pool.shape or k_pool.ndim != 4 or k_pool.dtype != v_pool.dtype:
        raise ValueError(
            f"k_pool {k_pool.dtype}{list(k_pool.shape)} and v_pool {v_pool.dtype}{list(v_pool.shape)} "
            "must both be [NB, BS, K, H] of one dtype"
        )
    num_kv_heads = k_pool.shape[2]
    if k_pool.shape[3] != head_dim:
        raise ValueError(f"q head_dim={head_dim} but the pools have head_dim={k_pool.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    return num_kv_heads, num_heads // num_kv_heads, head_dim


def flat_pools(k_pool: jax.Array, v_pool: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[NB, BS, K, H] -> [NB * BS, K, H] (a bitcast): kernels address tokens by slot."""
    nb, bs, kh, hd = k_pool.shape
    return k_pool.reshape(nb * bs, kh, hd), v_pool.reshape(nb * bs, kh, hd)


def rows_at(ref, *index):
    """`ref.at[index..., :]` for a mix of scalar and [R] vector indices -> an [R, H] view.

    The last dimension is indexed with an explicit iota rather than `:`: Pallas interpret mode
    cannot mix vector indices with slices, and Triton sees the same contiguous pointer block.
    """
    lanes = jnp.arange(ref.shape[-1])[None, :]
    index = tuple(i[:, None] if getattr(i, "ndim", 0) == 1 else i for i in index)
    return ref.at[(*index, lanes)]


def kv_slots(bt_ref, row, pos, block_size: int, num_pages: int):
    """Pool slots of key positions `pos` [BK] of block-table row `row` (a gather of the table).

    Page indices past the table are clamped: those positions are past the sequence and masked.
    """
    page = bt_ref[row, jnp.minimum(pos // block_size, num_pages - 1)]
    return page * block_size + pos % block_size


def online_softmax_step(q, k_ref, v_ref, slots, kv_head, load_mask, logit_mask, carry, qk_scale):
    """One flash-attention step over a tile of BK keys for BM packed query rows.

    Args:
      q: [BM, H] queries in the dots' compute dtype (`compute_dtype`).
      k_ref, v_ref: flat pools [NB * BS, K, H]; each tile is cast to q's dtype once loaded.
      slots: [BK] pool slots of the tile's keys; kv_head: the kv head.
      load_mask: [BK] keys that exist (others are not read and count as zero).
      logit_mask: [BM, BK] or None: which (row, key) pairs attend.
      carry: (acc [BM, H] f32 sum of p @ V as stored (v_scale is applied by the caller, once),
        m [BM] f32 running max in log2 units, l [BM] f32 running sum).
      qk_scale: softmax scale times log2(e) (exp2 is cheaper than exp) times the kv head's
        k_scale (dequantising K in the logits rather than in the tile).

    Returns:
      The updated carry.
    """
    acc, m, l = carry
    zero = jnp.zeros((), k_ref.dtype)  # in the pool's dtype: Triton casts no int to float8
    k = load(rows_at(k_ref, slots, kv_head), mask=load_mask[:, None], other=zero).astype(q.dtype)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * qk_scale
    mask = load_mask[None, :] if logit_mask is None else logit_mask & load_mask[None, :]
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    v = load(rows_at(v_ref, slots, kv_head), mask=load_mask[:, None], other=zero).astype(q.dtype)
    acc = acc * alpha[:, None] + jnp.dot(p.astype(q.dtype), v, preferred_element_type=jnp.float32)
    return acc, m_new, l * alpha + p.sum(axis=1)


def init_carry(rows: int, head_dim: int):
    """Zero accumulator, finite 'minus infinity' max, zero sum."""
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), MASK_VALUE, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
