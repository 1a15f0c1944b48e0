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
import math
import string
import typing

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.config.lora import pool_shapes, projection_dims
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


@typing.no_type_check  # JAX rebuilds pytrees from non-array leaves (shardings, specs)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoraAdapter:
    """One LoRA adapter as a JAX trainer holds it, in the engine's layout (the mesh's, as
    `get_params()`): per projection it adapts (`config.lora.lora_targets`' names), A `[L, *in, r]`
    and B `[L, r, *out]`; a token's delta is `x @ A @ B` (any scaling is part of B). A pytree:
    `jax.grad` gives an adapter's gradient as a `LoraAdapter`.

    Attributes:
      a: projection name -> `[L, *in, r]`.
      b: projection name -> `[L, r, *out]`.
    """

    a: dict[str, Float[Array, "..."]]
    b: dict[str, Float[Array, "..."]]


def init_lora(config: ModelConfig, rank: int, key: jax.Array, targets=None, dtype=jnp.float32) -> LoraAdapter:
    """A new adapter of `rank` for a model of `config` (the mesh's), initialised as PEFT does: A
    uniform in `+-1 / sqrt(in)` (kaiming-uniform, `a = sqrt(5)`), B zeros, so it starts as the
    base model. `targets`: the projections it adapts (default: every one `lora_targets` names).

    Raises:
      ValueError: a target the model does not adapt, or a rank below 1.
    """
    dims = projection_dims(config)
    targets = tuple(dims) if targets is None else tuple(targets)
    unknown = sorted(set(targets) - set(dims))
    if unknown or isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(
            f"init_lora: targets {unknown} / rank {rank!r}: give a rank >= 1 and some of {', '.join(dims)}"
        )
    a, b = {}, {}
    for name, k in zip(targets, jax.random.split(key, len(targets))):
        ins, outs = dims[name]
        bound = 1.0 / math.prod(ins) ** 0.5
        a[name] = jax.random.uniform(k, (config.num_layers, *ins, rank), dtype, -bound, bound)
        b[name] = jnp.zeros((config.num_layers, rank, *outs), dtype)
    return LoraAdapter(a, b)


def single_slot_pool(adapter: LoraAdapter) -> LoraPool:
    """A pool of one slot holding `adapter` (tokens of slot 1 run with it): what the scoring path
    differentiates through (`functional.token_logprobs(..., lora=adapter)`)."""
    return LoraPool(
        a={k: v[..., None, :] for k, v in adapter.a.items()}, b={k: v[:, None] for k, v in adapter.b.items()}
    )


def zero_pool(config: ModelConfig, max_loras: int, max_rank: int, dtype) -> LoraPool:
    """A pool with every slot empty (zeros: every slot computes a zero delta)."""
    shapes = pool_shapes(config, max_loras, max_rank)
    return LoraPool(
        a={name: jnp.zeros(a, dtype) for name, (a, _) in shapes.items()},
        b={name: jnp.zeros(b, dtype) for name, (_, b) in shapes.items()},
    )


def write_slot(pool: LoraPool, slot: Int[Array, ""], a: dict, b: dict) -> LoraPool:
    """The pool with slot `slot` (1..S) holding the adapter `a` (`[L, *in, r]` per projection) and
    `b` (`[L, r, *out]`), ranks `r` below the pool's zero-padded and a projection absent from `a`
    zeros; jit it with the pool donated (an in-place write: one program per set of ranks)."""
    i = slot - 1

    def put_a(pool_a, new):  # [L, *in, S, R] <- [L, *in, r]
        pad = [(0, 0)] * (new.ndim - 1) + [(0, pool_a.shape[-1] - new.shape[-1])]
        new = jnp.pad(new.astype(pool_a.dtype), pad)
        return jax.lax.dynamic_update_index_in_dim(pool_a, new, i, pool_a.ndim - 2)

    def put_b(pool_b, new):  # [L, S, R, *out] <- [L, r, *out]
        pad = [(0, 0), (0, pool_b.shape[2] - new.shape[1])] + [(0, 0)] * (new.ndim - 2)
        return jax.lax.dynamic_update_index_in_dim(pool_b, jnp.pad(new.astype(pool_b.dtype), pad), i, 1)

    def zeros_like_slot(x, axis):
        return jnp.zeros(x.shape[:axis] + x.shape[axis + 1 :], x.dtype)

    a = {k: a[k] if k in a else zeros_like_slot(v, v.ndim - 2) for k, v in pool.a.items()}
    b = {k: b[k] if k in b else zeros_like_slot(v, 1) for k, v in pool.b.items()}
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
