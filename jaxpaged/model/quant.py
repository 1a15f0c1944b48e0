"""Quantized weights and the matmuls that read them.

A weight in our layout `[*in, *out]` (see `jaxpaged.config.params.spec`) is quantized with one scale per
output channel into `[*out, *in]` (its quantized pair, declared with it there):

    fp8   q = saturate(w / s).astype(float8_e4m3fn), s = max|w| / 448 over the inputs
          x is quantized the same way per token at run time; y = (xq . q) * sx * s, the dot
          taking float8 operands into a float32 result (an H100's fp8 GEMM; XLA's CPU
          backend converts the operands to float32)
    int8  q = round(w / s).astype(int8), s = max|w| / 127; y = (x . q.astype(x.dtype)) * s
          (weight-only: activations keep the model's dtype)

Both store the contracted axes minor in both operands, the one layout cuBLASLt's fp8 GEMMs take
without a transpose. Dimension letters: T tokens; `*in`, `*out` the weight's input and output axes.
"""

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.spec import PERM_SUFFIX, QUANT_SUFFIX, SCALE_SUFFIX, ZERO_SUFFIX
from jaxpaged.model.group_quant import group_matmul, quantize_groups
from jaxpaged.model.sharded_group_matmul import kernel_on_every_device

FP8 = jnp.float8_e4m3fn


def _qmax(method: str) -> float:
    return float(jnp.finfo(FP8).max) if method == "fp8" else 127.0


def _to_storage(x: Float[Array, "..."], method: str) -> Array:
    """Scaled values to the method's storage type: saturated fp8, or rounded and clipped int8."""
    qmax = _qmax(method)
    if method == "fp8":
        return jnp.clip(x, -qmax, qmax).astype(FP8)
    return jnp.clip(jnp.round(x), -qmax, qmax).astype(jnp.int8)


def quantize_weight(w: Float[Array, "..."], method: str, num_in: int, num_lead: int = 0) -> tuple[Array, Array]:
    """Quantizes a weight with one scale per output channel.

    Args:
      w: `[*lead, *in, *out]` (lead: e.g. the stacked layers' axis).
      method: "fp8" or "int8".
      num_in: how many axes after the lead ones are inputs.
      num_lead: leading batch axes kept in front.

    Returns:
      `(q [*lead, *out, *in]` in the method's dtype, `scale [*lead, *out]` float32).
    """
    lead = tuple(range(num_lead))
    inputs = tuple(range(num_lead, num_lead + num_in))
    outputs = tuple(range(num_lead + num_in, w.ndim))
    wt = jnp.transpose(w.astype(jnp.float32), lead + outputs + inputs)
    reduce = tuple(range(wt.ndim - num_in, wt.ndim))
    amax = jnp.max(jnp.abs(wt), axis=reduce)
    scale = jnp.where(amax > 0, amax / _qmax(method), 1.0).astype(jnp.float32)
    return _to_storage(wt / scale.reshape(scale.shape + (1,) * num_in), method), scale


def quantize_param(
    w: Float[Array, "..."], method: str, config: ModelConfig, num_in: int, num_lead: int = 0
) -> tuple[Array, ...]:
    """A quantizable weight's replacement arrays, in the order of `quantized_paths(config, spec)`:
    its group-quantized triple when `config.weight_group_size` is set (`quantize_groups`; with
    `weight_act_order` an identity permutation after it), else its per-channel pair
    (`quantize_weight` with `method`)."""
    if config.weight_group_size is None:
        return quantize_weight(w, method, num_in, num_lead)
    arrays = quantize_groups(w, config.weight_bits, config.weight_group_size, num_in, num_lead)
    if not config.weight_act_order:
        return arrays
    num_features = math.prod(w.shape[num_lead : num_lead + num_in])
    return (*arrays, jnp.broadcast_to(jnp.arange(num_features, dtype=jnp.int32), (*w.shape[:num_lead], num_features)))


def matmul(x: Float[Array, "T ..."], w: Float[Array, "..."], num_in: int) -> Float[Array, "T ..."]:
    """`x [T, *in] . w [*in, *out] -> [T, *out]` for a plain weight."""
    contract = tuple(range(1, 1 + num_in)), tuple(range(num_in))
    return jax.lax.dot_general(x, w, (contract, ((), ())))


def quantized_matmul(
    x: Float[Array, "T ..."], q: Array, scale: Float[Array, "..."], method: str, num_in: int
) -> Float[Array, "T ..."]:
    """`x [T, *in]` times a quantized weight `q [*out, *in]` with `scale [*out]` -> `[T, *out]`
    in x's dtype, accumulated in float32."""
    dims = ((tuple(range(1, 1 + num_in)), tuple(range(q.ndim - num_in, q.ndim))), ((), ()))
    if method == "fp8":  # activations quantized per token, dynamically
        xq, x_scale = quantize_activations(x, num_in)
        y = jax.lax.dot_general(xq, q, dims, preferred_element_type=jnp.float32)
        y = y * x_scale.reshape(x.shape[0], *(1,) * (y.ndim - 1))
    else:
        y = jax.lax.dot_general(x, q.astype(x.dtype), dims, preferred_element_type=jnp.float32)
    return (y * scale).astype(x.dtype)


def quantize_activations(
    x: Float[Array, "T ..."], num_in: int, axis_name: str | None = None
) -> tuple[Array, Float[Array, "T 1"]]:
    """Each token's activations `x [T, *in]` in float8 by their own maximum (fp8 weights'
    dynamic activation quantization): `(xq [T, *in], scale [T, 1])`, `x ~ xq * scale`. With
    `axis_name` the inputs are split over that mesh axis (inside a `shard_map`) and the maximum
    is taken over all of them, so every device scales a token as one device would."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=tuple(range(1, 1 + num_in)))[:, None]
    if axis_name is not None:
        amax = jax.lax.pmax(amax, axis_name)
    x_scale = jnp.where(amax > 0, amax / _qmax("fp8"), 1.0)
    return _to_storage(x.astype(jnp.float32) / x_scale.reshape(x.shape[0], *(1,) * num_in), "fp8"), x_scale


def fp8_matmul(xq: Array, q: Array, scale: Float[Array, "..."], num_in: int) -> Float[Array, "T ..."]:
    """float8 activations `xq [T, *in]` (`quantize_activations`) times an fp8 weight `q [*out,
    *in]` with `scale [*out]` -> float32 `[T, *out]`, still to be multiplied by the activations'
    scales (a mixture of experts' grouped matmul quantizes its rows once, for every tile)."""
    dims = ((tuple(range(1, 1 + num_in)), tuple(range(q.ndim - num_in, q.ndim))), ((), ()))
    return jax.lax.dot_general(xq, q, dims, preferred_element_type=jnp.float32) * scale


def weight_matmul(
    x: Float[Array, "T ..."],
    arrays: Mapping[str, Array],
    name: str,
    quantization: str | None,
    num_in: int,
    group_kernel: bool = False,
) -> Float[Array, "T ..."]:
    """`x [T, *in]` times the weight `name` as `arrays` holds it (by its state names): plain
    (unquantized, or a projection the checkpoint left in float: `ModelConfig.float_weights`),
    its quantized pair, or its group-quantized triple (and act-order permutation) -> `[T, *out]`;
    `group_kernel`: a group-quantized one through the Pallas kernel, in every step
    (`group_matmul`)."""
    if name in arrays:
        return matmul(x, arrays[name], num_in)
    q, scale = arrays[name + QUANT_SUFFIX], arrays[name + SCALE_SUFFIX]
    if name + ZERO_SUFFIX in arrays:
        zero, perm = arrays[name + ZERO_SUFFIX], arrays.get(name + PERM_SUFFIX)
        return group_matmul(x, q, scale, zero, num_in, perm, kernel=group_kernel)
    return quantized_matmul(x, q, scale, quantization, num_in)


def project(module, name: str, x: Float[Array, "T ..."]) -> Float[Array, "T ..."]:
    """`x [T, *in]` through the weight `name` of a model `module` (its attributes `name` or
    `<name>_quant`, ..., `quantization` and `group_kernel`) -> `[T, *out]` (`weight_matmul`).
    With `kernel_parallel` set (tensor parallelism), a group-quantized weight in its stored
    input order goes through the kernel on every device over its shard (`kernel_on_every_device`;
    the module's `param_prefix` names its table path)."""
    names = (name, *(name + suffix for suffix in (QUANT_SUFFIX, SCALE_SUFFIX, ZERO_SUFFIX, PERM_SUFFIX)))
    arrays = {n: getattr(module, n)[...] for n in names if hasattr(module, n)}
    parallel = module.kernel_parallel  # set with the module's parameters (`ParamDeclarer.declare`)
    if parallel is not None and name + ZERO_SUFFIX in arrays and name + PERM_SUFFIX not in arrays:
        return kernel_on_every_device(
            parallel, module.param_prefix, name + QUANT_SUFFIX, name + SCALE_SUFFIX, name + ZERO_SUFFIX, arrays, x
        )
    # Under tensor parallelism an act-order weight takes XLA's product: a Pallas call's operands
    # split by GSPMD would be gathered whole on every device.
    kernel = module.group_kernel and parallel is None
    return weight_matmul(x, arrays, name, module.quantization, x.ndim - 1, kernel)
