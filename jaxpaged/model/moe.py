"""The sparse MLP of a mixture-of-experts decoder layer (Mixtral, Qwen2-MoE, Qwen3-MoE).

Dimension letters: T tokens in the step, D hidden, E experts, K experts per token (top-k),
M = T * K routed rows, F one expert's FFN width, S the shared expert's width.

1. Route (`route`), exactly as transformers does: logits `x . router` in the model's dtype,
   softmax in float32, top-k, renormalised when the config says so.
2. Sort the T * K (token, expert) pairs by expert (a stable argsort): each expert's rows are
   contiguous, `group_sizes[E]` says how many. No padding: the rows are exactly T * K (T is the
   step's token bucket), whatever the routing; an expert no token chose has an empty group.
3. The experts' SwiGLU over the sorted rows as three grouped matmuls (`jax.lax.ragged_dot`:
   row block e times expert e's weight).
4. Undo the permutation (a gather by the inverse order) and sum each token's K outputs weighted
   by its router weights.

What `ragged_dot` costs depends on how XLA lowers it: JAX 0.10 on a CPU and XLA's GPU compiler
(JAX 0.11, an H100) expand it into one dense product of every row with every expert, masked
(see benchmarks/results/moe_ragged_dot.md); a grouped-GEMM kernel would do T * K rows' work.
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.moe import MoeConfig
from jaxpaged.config.params import QUANT_SUFFIX, SCALE_SUFFIX
from jaxpaged.model.quant import matmul, quantize_weight, quantized_matmul


def route(
    x: Float[Array, "T D"], router: Float[Array, "D E"], moe: MoeConfig
) -> tuple[Float[Array, "T K"], Int[Array, "T K"]]:
    """Each token's top-k experts and their weights, as transformers computes them.

    Returns:
      `(weights [T, K]`, float32, or the model's dtype where transformers casts them (Qwen),
      `experts [T, K]` int32, best first).
    """
    logits = jnp.einsum("TD,DE->TE", x, router)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, moe.top_k)
    if moe.normalize_top_k:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if moe.weights_in_model_dtype:
        weights = weights.astype(x.dtype)
    return weights, experts.astype(jnp.int32)


def sort_by_expert(experts: Int[Array, "T K"], num_experts: int) -> tuple[Int[Array, " M"], Int[Array, " E"]]:
    """The order that groups the flattened (token, expert) rows by expert, and each group's size."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return order, group_sizes


def grouped_matmul(
    rows: Float[Array, "M I"], module: nnx.Module, name: str, group_sizes: Int[Array, " E"]
) -> Float[Array, "M O"]:
    """`rows` (sorted by expert, `group_sizes` of them each) times each group's expert weight
    `name` of `module`: plain `[E, I, O]`, or its quantized pair `[E, O, I]` with `[E, O]` scales."""
    if module.quantization is None:
        return jax.lax.ragged_dot(rows, getattr(module, name)[...], group_sizes)
    q, scale = getattr(module, name + QUANT_SUFFIX)[...], getattr(module, name + SCALE_SUFFIX)[...]
    dims = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])
    if module.quantization == "fp8":  # each row quantized with its own scale, as `quantized_matmul` does
        xq, x_scale = quantize_weight(rows, "fp8", num_in=1, num_lead=1)
        y = jax.lax.ragged_dot_general(xq, q, group_sizes, dims, preferred_element_type=jnp.float32)
        y = y * x_scale[:, None]
    else:
        y = jax.lax.ragged_dot_general(
            rows, q.astype(rows.dtype), group_sizes, dims, preferred_element_type=jnp.float32
        )
    expert_of_row = jnp.repeat(jnp.arange(q.shape[0]), group_sizes, total_repeat_length=rows.shape[0])
    return (y * scale[expert_of_row]).astype(rows.dtype)


def _project(module: nnx.Module, name: str, x: Float[Array, "T I"]) -> Float[Array, "T O"]:
    """`x` through the dense weight `name` of `module` (plain or its quantized pair)."""
    if module.quantization is None:
        return matmul(x, getattr(module, name)[...], 1)
    q, scale = getattr(module, name + QUANT_SUFFIX)[...], getattr(module, name + SCALE_SUFFIX)[...]
    return quantized_matmul(x, q, scale, module.quantization, 1)


def combine(
    expert_rows: Float[Array, "M D"], order: Int[Array, " M"], weights: Float[Array, "T K"]
) -> Float[Array, "T D"]:
    """Each token's K expert outputs (rows in expert order) summed with its router weights."""
    num_tokens, top_k = weights.shape
    unsorted = expert_rows[jnp.argsort(order)].reshape(num_tokens, top_k, -1)  # the inverse permutation
    out = jnp.einsum("TKD,TK->TD", unsorted, weights, preferred_element_type=jnp.float32)
    return out.astype(expert_rows.dtype)


class SparseMoe(nnx.Module):
    """A layer's router, experts (and Qwen2-MoE's gated shared expert), from the table's
    parameters under `("layers", "moe")` (stacked over the layers, or per-layer arrays)."""

    def __init__(self, config: ModelConfig, params):
        params.declare(self, ("layers", "moe"))  # router [D, E], experts [E, D, F] / [E, F, D], shared ones
        self.moe = config.moe
        self.quantization = params.quantization
        self.shared_expert = hasattr(self, "shared_expert_gate")

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        weights, experts = route(x, self.router[...], self.moe)
        order, group_sizes = sort_by_expert(experts, self.moe.num_experts)
        rows = x[order // self.moe.top_k]  # [M, D]: each routed row's token, in expert order
        gate = grouped_matmul(rows, self, "gate_proj", group_sizes)
        up = grouped_matmul(rows, self, "up_proj", group_sizes)
        out = combine(grouped_matmul(jax.nn.silu(gate) * up, self, "down_proj", group_sizes), order, weights)
        if self.shared_expert:
            shared = _project(self, "shared_gate_proj", x)
            shared = _project(self, "shared_down_proj", jax.nn.silu(shared) * _project(self, "shared_up_proj", x))
            out = out + jax.nn.sigmoid(x @ self.shared_expert_gate[...])[:, None] * shared
        return out


def dense_experts_reference(
    x: Float[Array, "T D"],
    weights: Float[Array, "T K"],
    experts: Int[Array, "T K"],
    gate: Float[Array, "E D F"],
    up: Float[Array, "E D F"],
    down: Float[Array, "E F D"],
) -> Float[Array, "T D"]:
    """Every token through every expert (`E / K` times the work), combined by the routing: the
    oracle of the grouped computation, and its peer in the benchmark."""
    h = jax.nn.silu(jnp.einsum("TD,EDF->ETF", x, gate)) * jnp.einsum("TD,EDF->ETF", x, up)
    y = jnp.einsum("ETF,EFD->ETD", h, down)
    mix = jnp.einsum("TK,TKE->ET", weights.astype(jnp.float32), jax.nn.one_hot(experts, gate.shape[0]))
    return jnp.einsum("ETD,ET->TD", y, mix, preferred_element_type=jnp.float32).astype(x.dtype)
