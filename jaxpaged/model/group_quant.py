"""Group-quantized weights (4 or 8 bits, a scale and a zero point per group of input features)
and the matmul that reads them without writing a widened copy of the weight for decode.

A weight in our layout `[*in, *out]` is held as three arrays (`ParamSpec.grouped_paths`):

    <name>_quant  [*in, *out]  codes c - 2**(bits-1), in int4 (4 bits; int8 on a CPU, see
                               `code_dtype`) or int8 (8 bits)
    <name>_scale  [G, *out]    float32 scale s of each group of `group_size` flattened inputs
    <name>_zero   [G, *out]    int8 zero point z - 2**(bits-1)
    <name>_perm   [I]          int32, only with `weight_act_order`: stored row i reads input perm[i]

    w[i, o] = (c[i, o] - z[g, o]) * s[g, o],   g = i // group_size

GPTQ's `desc_act` checkpoints (groups not contiguous along the inputs, `g_idx`) are stored with
their inputs sorted by group, contiguous again, and the activation's features gathered by `perm`
before the product (a `[T, I]` gather, small beside the weight; under tensor parallelism a
row-parallel layer's activation is gathered whole first). Permuting the weight instead would need
a `[I, O]` scale per element: the widened copy this layout exists to avoid.

(`jaxpaged.checkpoint.group_quant.GroupQuantized` is the same meaning with unsigned codes, in the
Hugging Face linear's features.) Codes are signed because XLA's GPU compiler fuses a convert from
int4/int8 into its Triton GEMM fusions (the weight enters the GEMM as it lies) but materialises a
convert from uint4/uint8; it fuses no group-broadcast scale multiply into a GEMM operand at all
(measured on the programs compiled for an H100, jax 0.11.2; see benchmarks/results/README.md).
So `group_matmul` contracts each group separately, the scale applied to the partial sums:

    y[t, o] = sum_g s[g, o] * (sum_{i in g} x[t, i] c[i, o]) - sum_g s[g, o] z[g, o] xsum[t, g]

a batched dot over the groups (accumulated in float32 inside the GEMM) whose partials
`[G, T, *out]`, rounded to x's dtype, are written instead of a widened weight and summed in
float32. That is fewer bytes than a widened weight while T <= group_size (every decode bucket up
to 128 sequences at the default group size): per weight, 4-bit codes plus `2 * T / group_size`
elements of partials written and read back, against a widened weight written and read back. Above
it the weight is dequantized into a temporary in x's dtype and multiplied in one dot, which XLA
writes to memory (and, in a program of fused decode steps, may hoist out of the loop: several
layers' widened weights held at once). These XLA products serve a CPU, tensor-parallel splits
and weights the kernel refuses. The Pallas kernel `pallas_kernels.group_quant_matmul` dequantizes
in registers and reads the codes alone, for any number of tokens: `kernel=True` (the model's
choice on a GPU with its weights unsplit, `jaxpaged.model.llama.Llama`) runs it in every step
whose weight it takes (`pallas_kernels.quant_matmul.unsupported`), so no step program there
writes a widened weight.
Dimension letters: T tokens, I flattened inputs, O flattened outputs, G groups.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Integer

import pallas_kernels
from jaxpaged.config.quantization import GROUP_CODE_DTYPES
from pallas_kernels.quant_matmul import unsupported


def code_dtype(bits: int, platform: str | None = None) -> jnp.dtype:
    """The dtype codes of `bits` are stored in on `platform` (None: the platform the programs being
    traced are for, `pallas_kernels.target_platform()`): `GROUP_CODE_DTYPES`, except int8 for 4
    bits on a CPU. XLA's CPU backend holds int4 unpacked (a byte each, so int8 costs nothing
    more), and its int4 arrays split over several devices come with a layout its compiled
    programs refuse (jax 0.10.2: "compiled for input layouts that disagree").
    """
    platform = platform or pallas_kernels.target_platform()
    return jnp.dtype("int8" if platform == "cpu" else GROUP_CODE_DTYPES[bits])


def quantize_groups(
    w: Float[Array, "..."], bits: int, group_size: int, num_in: int, num_lead: int = 0
) -> tuple[Integer[Array, "..."], Float[Array, "..."], Integer[Array, "..."]]:
    """Round-to-nearest, asymmetric (min-max) group quantization: each group's range `[min(w),
    max(w)]` (widened to hold 0) maps onto the codes `0 .. 2**bits - 1`, its zero point the code of
    0. Asymmetric because a group's weights are rarely centred: all 16 levels cover its range,
    where a symmetric code wastes a half-range on the side it does not reach.

    Args:
      w: `[*lead, *in, *out]`.
      bits: 4 or 8.
      group_size: flattened inputs per group (divides them).
      num_in: how many axes after the lead ones are inputs.
      num_lead: leading batch axes kept in front (the stacked layers' axis).

    Returns:
      `(codes [*lead, *in, *out], scale [*lead, G, *out] float32, zero [*lead, G, *out] int8)`.
    """
    lead, ins, outs = w.shape[:num_lead], w.shape[num_lead : num_lead + num_in], w.shape[num_lead + num_in :]
    groups, qmax, offset = math.prod(ins) // group_size, 2**bits - 1, 2 ** (bits - 1)
    wg = w.astype(jnp.float32).reshape(*lead, groups, group_size, *outs)
    lo = jnp.minimum(jnp.min(wg, axis=num_lead + 1), 0.0)
    hi = jnp.maximum(jnp.max(wg, axis=num_lead + 1), 0.0)
    scale = jnp.where(hi > lo, (hi - lo) / qmax, 1.0)
    zero = jnp.clip(jnp.round(-lo / scale), 0, qmax)
    codes = jnp.clip(
        jnp.round(wg / jnp.expand_dims(scale, num_lead + 1)) + jnp.expand_dims(zero, num_lead + 1), 0, qmax
    )
    return (
        (codes - offset).astype(code_dtype(bits)).reshape(w.shape),
        scale,
        (zero - offset).astype(jnp.int8),
    )


def group_matmul(
    x: Float[Array, "T ..."],
    codes: Integer[Array, "..."],
    scale: Float[Array, "G ..."],
    zero: Integer[Array, "G ..."],
    num_in: int,
    perm: Integer[Array, " I"] | None = None,
    kernel: bool = False,
) -> Float[Array, "T ..."]:
    """`x [T, *in]` times the group-quantized weight `(codes [*in, *out], scale, zero [G, *out])`
    (its inputs stored in the order `perm`, when given) -> `[T, *out]` in x's dtype, accumulated
    in float32 (see the module docstring). `kernel`: run `pallas_kernels.group_quant_matmul`
    (interpreted off a GPU) for any number of tokens, where it takes the weight."""
    num_tokens, ins, outs = x.shape[0], codes.shape[:num_in], codes.shape[num_in:]
    groups, num_out = scale.shape[0], math.prod(outs)
    group_size = math.prod(ins) // groups
    if perm is not None:
        x = jnp.take(x.reshape(num_tokens, -1), perm, axis=1)
    if kernel and unsupported(codes.dtype, group_size, num_out) is None:
        y = pallas_kernels.group_quant_matmul(
            x.reshape(num_tokens, -1),
            codes.reshape(-1, num_out),
            scale.reshape(groups, num_out),
            zero.reshape(groups, num_out),
        )
        return y.reshape(num_tokens, *outs)
    xg = x.reshape(num_tokens, groups, group_size)
    q = codes.reshape(groups, group_size, num_out)
    s = scale.reshape(groups, num_out).astype(jnp.float32)
    z = zero.reshape(groups, num_out).astype(jnp.float32)
    if num_tokens <= group_size:  # the partials are smaller than a widened weight
        partials = jax.lax.dot_general(
            xg, q.astype(x.dtype), (((2,), (1,)), ((1,), (0,))), preferred_element_type=x.dtype
        )  # [G, T, O]
        xsum = jnp.sum(xg.astype(jnp.float32), axis=2)  # [T, G]
        y = jnp.einsum("gto,go->to", partials.astype(jnp.float32), s) - jnp.einsum("tg,go->to", xsum, s * z)
    else:
        w = ((q.astype(jnp.float32) - z[:, None]) * s[:, None]).astype(x.dtype)
        y = jax.lax.dot_general(xg, w, (((1, 2), (0, 1)), ((), ())), preferred_element_type=jnp.float32)  # [T, O]
    return y.astype(x.dtype).reshape(num_tokens, *outs)
