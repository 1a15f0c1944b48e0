"""Activations times a group-quantized 4- or 8-bit weight, dequantized inside a Pallas Triton kernel.

The weight is `jaxpaged.model.group_quant`'s layout, flattened to `[K, N]`:

    w[k, n] = (codes[k, n] - zero[g, n]) * scale[g, n],   g = k // group_size

Grid (row block m, column block j, split s). A program owns BM rows of x (`row_block`: all of a
decode step's up to 64 tokens, else 64- or 128-row blocks, the tail padded with zero rows), BN
output columns and the s-th of `splits` equal runs of the BK-row tiles along K (BK =
min(group_size, 128): a tile never straddles two groups). Each step loads a `[BK, BN]` tile of
codes as stored, subtracts the group's zero points in registers (exact small integers in x's
dtype), multiplies it by the `[BM, BK]` activation tile into float32 and scales that by the
group's scales: the weight is read as codes (once per row block; the row blocks vary fastest in
the grid so that a column block's codes are re-read from L2, not measured on a GPU) and no dequantized weight or per-group
partial product ever leaves registers (XLA's `group_matmul` writes one or the other). With one
split (above 64 tokens, unless K is long and the codes 8-bit: `num_splits`) the program stores
its rows of the result in x's dtype; with several, each stores its float32 sum and XLA adds them
(`[S, R, N]`, a few of them for a decode step: small beside the weight).

4-bit codes (`jnp.int4`, two per byte on a GPU, the even column in the low nibble) are read as the
bytes they are (`bitcast_convert_type`, no copy): a byte column holds output columns 2c and 2c+1,
unpacked by shifts into two tiles, each with its own accumulator; scales, zero points and the
output are addressed as `[.., N / 2, 2]` to match, so the result needs no reordering.

Dimension letters: T tokens (padded to R, a whole number of BM >= 16 row blocks for `dot`), K
inputs, N outputs, G groups, P codes per stored column (2 for int4, else 1), S splits.
"""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

from pallas_kernels import _common as c

_MAX_BLOCK_K = 128
_BLOCK_COLUMNS = 64  # stored columns per program: 128 outputs at 4 bits, 64 at 8
_NUM_WARPS = 4
_MAX_ONE_BLOCK = 64  # tokens one row block holds; more are split into blocks of this many rows
_LARGE_STEP = 1024  # tokens from which the row blocks double (128 rows, 8 warps)
_NUM_STAGES = 2
# Programs wanted in flight (~2 per SM of an H100). Splits along K are added until reached, at most
# `_MAX_SPLITS`, and only while the splits' float32 outputs (written, then read back by XLA) stay
# within 1/8 of the codes' bytes: e.g. 2 splits for 16 tokens of a 4096-input 4-bit weight, none
# for more than 64 of its tokens.
_TARGET_PROGRAMS = 264
_MAX_SPLITS = 4
CODE_DTYPES = (jnp.dtype(jnp.int4), jnp.dtype(jnp.int8))


def unsupported(code_dtype, group_size: int, num_out: int) -> str | None:
    """Why the kernel cannot multiply codes of `code_dtype` in groups of `group_size` inputs into
    `num_out` outputs, or None when it can: codes int4 or int8, a group size that tiles (a power
    of two from 16, or a multiple of 128), an even `num_out` at 4 bits (two codes per byte)."""
    block = min(group_size, _MAX_BLOCK_K)
    if jnp.dtype(code_dtype) not in CODE_DTYPES:
        return f"codes of dtype {jnp.dtype(code_dtype)}: the kernel reads int4 or int8 codes"
    if group_size % block or block < 16 or block & (block - 1):
        return f"group_size={group_size}: the kernel takes a power of two from 16 or a multiple of 128"
    if jnp.dtype(code_dtype) == jnp.int4 and num_out % 2:
        return f"{num_out} outputs: the kernel reads int4 codes two per byte and needs an even count"
    return None


def num_splits(num_blocks: int, num_tiles: int, rows: int, num_in: int, bits: int) -> int:
    """Static split count along K: a power of two bringing `num_blocks` (row x column) blocks
    towards the target program count, at most `_MAX_SPLITS`, one per K tile, and as many as keep the splits'
    outputs (`8 * rows` bytes per split and output column, written and read) within 1/8 of the
    codes (`num_in * bits / 8` bytes per output column)."""
    wanted = c.next_pow2(-(-_TARGET_PROGRAMS // num_blocks))
    affordable = num_in * bits // (8 * 8 * 8 * rows)
    return max(1, min(wanted, _MAX_SPLITS, num_tiles, affordable))


def _kernel(
    x_ref,  # [R, K]
    q_ref,  # [K, N / P] int8
    s_ref,  # [G, N / P, P] float32
    z_ref,  # [G, N / P, P] int8
    o_ref,  # [S, R, BN * column blocks, P]: float32, or x's dtype when S = 1
    *,
    block_m: int,
    block_k: int,
    group_size: int,
    tiles_per_split: int,
    num_tiles: int,
):
    m, j, s = c.pl.program_id(0), c.pl.program_id(1), c.pl.program_id(2)
    columns, packing = q_ref.shape[1], s_ref.shape[2]
    out_cols = j * _BLOCK_COLUMNS + jnp.arange(_BLOCK_COLUMNS)  # the output's columns are padded
    col_ok = out_cols < columns
    cols = jnp.minimum(out_cols, columns - 1)  # masked columns read the last one, never out of bounds
    r, k = m * block_m + jnp.arange(block_m), jnp.arange(block_k)  # this program's rows (x is padded)

    def body(i, accs):
        row0 = i * block_k
        g = row0 // group_size
        x = c.load(x_ref.at[r[:, None], (row0 + k)[None, :]])  # [BM, BK]
        q = c.load(q_ref.at[(row0 + k)[:, None], cols[None, :]], mask=col_ok[None, :], other=0)
        q = q.astype(jnp.int32)  # [BK, BN]
        halves = ((q << 28) >> 28, q >> 4) if packing == 2 else (q,)  # sign-extended nibbles
        out = []
        for h, (acc, codes) in enumerate(zip(accs, halves)):
            zero = c.load(z_ref.at[g, cols, h], mask=col_ok, other=0).astype(jnp.int32)
            scale = c.load(s_ref.at[g, cols, h], mask=col_ok, other=0.0)
            w = (codes - zero[None, :]).astype(x.dtype)
            acc = acc + jnp.dot(x, w, preferred_element_type=jnp.float32) * scale[None, :]
            out.append(acc)
        return tuple(out)

    lo = s * tiles_per_split
    hi = jnp.minimum(lo + tiles_per_split, num_tiles)
    init = tuple(jnp.zeros((block_m, _BLOCK_COLUMNS), jnp.float32) for _ in range(packing))
    accs = jax.lax.fori_loop(lo, hi, body, init)
    for h, acc in enumerate(accs):  # the two halves' columns interleave in the output as stored
        c.store(o_ref.at[s, r[:, None], out_cols[None, :], h], acc.astype(o_ref.dtype))


def row_block(num_tokens: int) -> tuple[int, int]:
    """`(rows per program BM, warps)` for a step of `num_tokens`: up to 64 tokens one program's rows
    hold them all (the power of two from 16 above); more take 64-row blocks, and from 1,024
    tokens 128-row blocks over 8 warps, so the weight (re-read once per row block) is read fewer
    times. Either way the
    float32 accumulators are 64 (4 bits: 2 x 64) columns x BM rows, at most 64 registers a thread."""
    if num_tokens <= _MAX_ONE_BLOCK:
        return max(16, c.next_pow2(num_tokens)), _NUM_WARPS
    if num_tokens < _LARGE_STEP:
        return _MAX_ONE_BLOCK, _NUM_WARPS
    return 2 * _MAX_ONE_BLOCK, 2 * _NUM_WARPS


def group_quant_matmul(
    x: Float[Array, "T K"],
    codes: Integer[Array, "K N"],
    scale: Float[Array, "G N"],
    zero: Integer[Array, "G N"],
    *,
    interpret: bool | None = None,
) -> Float[Array, "T N"]:
    """`x` times the group-quantized weight `(codes, scale, zero)`, accumulated in float32.

    Args:
      x: activations, any float dtype (the dots run in it), any number of tokens.
      codes: `c - 2**(bits-1)`, int4 or int8 (`jaxpaged.model.group_quant.quantize_groups`).
      scale: float32 scale of each group of `K / G` inputs and output column.
      zero: int8 zero point (minus the same offset) of each group and output column.
      interpret: run in the Pallas interpreter; `None` interprets unless the target is a GPU.

    Returns:
      `[T, N]` in x's dtype.

    Raises:
      ValueError: inconsistent shapes, or a weight the kernel does not take (`unsupported`),
        naming the shapes.
    """
    (num_tokens, num_in), (groups, num_out) = x.shape, scale.shape
    if codes.shape != (num_in, num_out) or zero.shape != scale.shape or num_in % groups:
        raise ValueError(
            f"x {list(x.shape)}, codes {list(codes.shape)}, scale {list(scale.shape)}, zero {list(zero.shape)}: "
            "want x [T, K], codes [K, N], scale and zero [G, N] with G dividing K"
        )
    group_size = num_in // groups
    reason = unsupported(codes.dtype, group_size, num_out)
    if reason is not None:
        raise ValueError(f"codes {codes.dtype}{list(codes.shape)} in {groups} groups: {reason}")
    packing = 2 if codes.dtype == jnp.int4 else 1
    bk = min(group_size, _MAX_BLOCK_K)
    columns = num_out // packing
    if packing == 2:  # the bytes as stored: [K, N/2, 2] int4 -> [K, N/2] int8
        codes = jax.lax.bitcast_convert_type(codes.reshape(num_in, columns, 2), jnp.int8)
    block_m, num_warps = row_block(num_tokens)
    row_blocks = -(-num_tokens // block_m)
    rows = row_blocks * block_m
    num_blocks, num_tiles = -(-columns // _BLOCK_COLUMNS), num_in // bk
    splits = num_splits(num_blocks * row_blocks, num_tiles, rows, num_in, 8 // packing)
    out_dtype = x.dtype if splits == 1 else jnp.float32  # one split writes the result itself
    kernel = functools.partial(
        _kernel,
        block_m=block_m,
        block_k=bk,
        group_size=group_size,
        tiles_per_split=-(-num_tiles // splits),
        num_tiles=num_tiles,
    )
    out = c.pl.pallas_call(
        kernel,
        # row blocks vary fastest: the programs running together share a column block's codes
        grid=(row_blocks, num_blocks, splits),
        out_shape=jax.ShapeDtypeStruct((splits, rows, num_blocks * _BLOCK_COLUMNS, packing), out_dtype),
        compiler_params=c.compiler_params(num_warps=num_warps, num_stages=_NUM_STAGES),
        interpret=c.resolve_interpret(interpret),
        name="group_quant_matmul",
    )(
        jnp.pad(x, ((0, rows - num_tokens), (0, 0))),
        codes,
        scale.astype(jnp.float32).reshape(groups, columns, packing),
        zero.astype(jnp.int8).reshape(groups, columns, packing),
    )
    y = out[0] if splits == 1 else out.sum(axis=0)  # [R, N / P padded, P]
    return y[:num_tokens, :columns].reshape(num_tokens, num_out).astype(x.dtype)
