"""LoRA deltas for many adapters in one batch, and the adapter pool they read.

The pool (`LoraPool`, part of the `DeviceCache`) holds `S = max_loras` slots per projection:
A as `[L, *in, S, R]` and B as `[L, S, R, *out]` (R = `max_lora_rank`; PEFT's scaling folded into
B, smaller ranks zero-padded). Each token carries its sequence's slot (`StepInput.lora_slots`:
1..S, 0 for the base model). A projection's delta for the whole batch is two einsums, with no
loop over adapters and no per-token gather of weights:

    h     = x @ A            [T, S, R]   every slot's shrink of every token (S * R columns)
    h    *= onehot(slot)     [T, S]      each token keeps its own adapter's R columns (none: zero)
    delta = h @ B            [T, *out]   its expand

so a step costs `2 T S R (in + out)` FLOPs per projection, temporaries `[T, S, R]`, and a token
of the base model gets an exact zero. The slot's value is data: loading an adapter into a slot
(`write_slot`) changes no program.
"""

import dataclasses
import string
import typing

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.config.lora import pool_shapes
from jaxpaged.config.model_config import ModelConfig


@typing.no_type_check  # JAX rebuilds pytrees from non-array leaves (shardings, specs)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraPool:
    """Every slot's adapter weights, per projection name (`config.lora.lora_targets`).

    Attributes:
      a: `[L, *in, S, R]` per projection (a layer's slice: `[*in, S, R]`).
      b: `[L, S, R, *out]` per projection (a layer's slice: `[S, R, *out]`).
    """

    a: dict[str, Float[Array, "..."]]
    b: dict[str, Float[Array, "..."]]


@typing.no_type_check  # JAX rebuilds pytrees from non-array leaves (shardings, specs)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerLora:
    """One layer's adapter weights and the step's tokens' slots, as the projections read them.

    Attributes:
      a, b: the layer's slices of `LoraPool.a` and `.b`.
      onehot: `[T, S]` token t uses slot s + 1 (all zeros: the base model).
    """

    a: dict[str, Float[Array, "..."]]
    b: dict[str, Float[Array, "..."]]
    onehot: Float[Array, "T S"]


def zero_pool(config: ModelConfig, max_loras: int, max_rank: int, dtype) -> LoraPool:
    """A pool with every slot empty (zeros: every slot computes a zero delta)."""
    shapes = pool_shapes(config, max_loras, max_rank)
    return LoraPool(
        a={name: jnp.zeros(a, dtype) for name, (a, _) in shapes.items()},
        b={name: jnp.zeros(b, dtype) for name, (_, b) in shapes.items()},
    )


def write_slot(pool: LoraPool, slot: Int[Array, ""], a: dict, b: dict) -> LoraPool:
    """The pool with slot `slot` (1..S) holding the adapter `a` (`[L, *in, R]` per projection) and
    `b` (`[L, R, *out]`); jit it with the pool donated (an in-place write)."""
    i = slot - 1

    def put_a(pool_a, new):  # [L, *in, S, R] <- [L, *in, R]
        return jax.lax.dynamic_update_index_in_dim(pool_a, new.astype(pool_a.dtype), i, pool_a.ndim - 2)

    def put_b(pool_b, new):  # [L, S, R, *out] <- [L, R, *out]
        return jax.lax.dynamic_update_index_in_dim(pool_b, new.astype(pool_b.dtype), i, 1)

    return LoraPool(a={k: put_a(v, a[k]) for k, v in pool.a.items()}, b={k: put_b(v, b[k]) for k, v in pool.b.items()})


def token_onehot(lora_slots: Int[Array, " T"], num_slots: int, dtype) -> Float[Array, "T S"]:
    """`[T, S]`: token t's slot as a one-hot row (slot 0, the base model: zeros)."""
    return (lora_slots[:, None] == jnp.arange(1, num_slots + 1, dtype=lora_slots.dtype)[None, :]).astype(dtype)


def lora_delta(lora: LayerLora | None, name: str, x: Float[Array, "T ..."]) -> Float[Array, "T ..."] | float:
    """The adapters' delta of projection `name` for input `x` `[T, *in]` -> `[T, *out]` (0 without
    adapters, or for a projection the pool does not hold)."""
    if lora is None or name not in lora.a:
        return 0.0
    a, b = lora.a[name], lora.b[name]
    n_in, n_out = a.ndim - 2, b.ndim - 2
    ins, outs = string.ascii_lowercase[:n_in], string.ascii_lowercase[n_in : n_in + n_out]
    h = jnp.einsum(f"t{ins},{ins}sr->tsr", x, a.astype(x.dtype))
    h = h * lora.onehot.astype(h.dtype)[:, :, None]
    return jnp.einsum(f"tsr,sr{outs}->t{outs}", h, b.astype(x.dtype))
