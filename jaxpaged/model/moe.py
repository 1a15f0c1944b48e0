"""The sparse MLP of a mixture-of-experts decoder layer (Mixtral, Qwen2-MoE, Qwen3-MoE).

Dimension letters: T tokens in the step, D hidden, E experts, K experts per token (top-k),
M = T * K routed rows, F one expert's FFN width, S the shared expert's width.

1. Route (`route`), exactly as transformers does: logits `x . router` in the model's dtype,
   softmax in float32, top-k, renormalised when the config says so.
2. Sort the T * K (token, expert) pairs by expert (a stable argsort): each expert's rows are
   contiguous, `group_sizes[E]` says how many. No padding: the rows are exactly T * K (T is the
   step's token bucket), whatever the routing; an expert no token chose has an empty group.
3. The experts' SwiGLU over the sorted rows as three grouped matmuls (grouped_matmul.py: row
   group e times expert e's weight; the work is the M rows plus a bounded padding, not M x E),
   each a loop of XLA GEMMs over tiles of rows, or with the Pallas kernels (plain weights whose
   widths it takes) one kernel reading each tile's expert weight in place
   (pallas_kernels/grouped_matmul.py, the same tile schedule).
4. Undo the permutation (a gather by the inverse order) and sum each token's K outputs weighted
   by its router weights.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, Int

import pallas_kernels
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.moe import MoeConfig
from jaxpaged.config.params.spec import QUANT_SUFFIX, SCALE_SUFFIX, ZERO_SUFFIX
from jaxpaged.config.params.tables import find_state_param, quantized_paths
from jaxpaged.model.grouped_matmul import grouped_matmul, tile_rows, tile_schedule
from jaxpaged.model.quant import fp8_matmul, project, quantize_activations, weight_matmul
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.parallel.sharding import TENSOR_AXIS


def route(
    x: Float[Array, "T D"], router: Float[Array, "D E"], moe: MoeConfig
) -> tuple[Float[Array, "T K"], Int[Array, "T K"]]:
    """Each token's top-k experts and their weights, as transformers computes them.

    Returns:
      `(weights [T, K]`, float32, or the model's dtype where transformers casts them (Qwen),
      `experts [T, K]` int32, best first: their slots, `MoeConfig.expert_slots`).
    """
    logits = jnp.einsum("TD,DE->TE", x, router)
    if moe.empty_slots:  # expert slots that hold no expert (expert parallelism): never chosen
        logits = logits.at[:, list(moe.empty_slots)].set(-jnp.inf)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, moe.top_k)
    if moe.normalize_top_k:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if moe.weights_in_model_dtype:
        weights = weights.astype(x.dtype)
    return weights, experts.astype(jnp.int32)


def sort_by_expert(
    experts: Int[Array, "T K"], num_experts: int, first_expert: Int[Array, ""] | int = 0
) -> tuple[Int[Array, " M"], Int[Array, " E"]]:
    """The order that groups the flattened (token, expert) rows by expert, and each group's size,
    over the experts `first_expert ..` `+ num_experts` (one device's under expert parallelism):
    rows routed to other experts sort last, in no group, and are never computed."""
    local = experts.reshape(-1) - first_expert
    local = jnp.where((local >= 0) & (local < num_experts), local, num_experts)
    order = jnp.argsort(local, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[local].add(1)[:num_experts]
    return order, group_sizes


def expert_matmul(
    arrays: dict[str, Array], quantization: str | None, name: str
) -> Callable[[Float[Array, "TM I"], Int[Array, ""]], Float[Array, "TM O"]]:
    """`(tile, e) -> tile` times expert e's weight `name`: plain `[E, I, O]`, its quantized pair
    `[E, O, I]` with `[E, O]` scales, or its group-quantized triple `[E, I, O]` with `[E, G, O]`
    scales and zero points (the dense layers' matmuls, on one expert's slice of each array).

    A group-quantized tile is multiplied group by group (`group_matmul`'s partials): a tile has at
    most `MAX_TILE_ROWS` rows, no more than a group at the default size, so its partials
    `[G, TM, O]` are at most a widened expert weight's size, and while decoding (one row per
    tile) 1 / group_size of it; dequantizing instead would write a widened copy of the expert's
    weight for every tile, while the dots read the codes as they lie."""
    names = [n for n in arrays if n == name or n.startswith(name + "_")]
    return lambda x, e: weight_matmul(x, {n: arrays[n][e] for n in names}, name, quantization, 1)


def experts_ffn(
    arrays: dict[str, Array],
    quantization: str | None,
    top_k: int,
    x: Float[Array, "T D"],
    weights: Float[Array, "T K"],
    experts: Int[Array, "T K"],
    first_expert: Int[Array, ""] | int = 0,
    kernels: bool = False,
    split_axis: str | None = None,
) -> Float[Array, "T D"]:
    """Every token through its experts' SwiGLU (steps 2-4 of the module docstring).

    Args:
      arrays: the experts' weights by name (`gate_proj`, ... or their quantized pairs or
        group-quantized triples; a checkpoint may leave some in float): all of them, or one
        device's share (of their FFN width, or of the experts from `first_expert`).
      quantization: None, "fp8", "int8" or a group-quantized method (arrays with zero points).
      kernels: plain (float) weights go through the Pallas grouped-matmul kernel where it takes
        their widths (`pallas_kernels.grouped_matmul_supports`); else, and for quantized ones,
        XLA's tile loop.
      split_axis: the mesh axis the experts' FFN width is split over (inside `on_every_device`
        without expert parallelism): fp8 experts scale each row of the down projection's inputs
        by its maximum over all of them, as one device does.
    """
    num_experts, width = _experts_and_width(arrays, "gate_proj")
    order, group_sizes = sort_by_expert(experts, num_experts, first_expert)
    rows = x[order // top_k]  # [M, D]: each routed row's token, in expert order

    def grouped(rows, name, out_width, axis_name=None):
        if kernels and name in arrays and pallas_kernels.grouped_matmul_supports(rows.shape[1], out_width):
            tile = tile_rows(rows.shape[0], num_experts)
            schedule = tile_schedule(group_sizes, rows.shape[0], tile)
            return pallas_kernels.grouped_matmul(rows, arrays[name], *schedule, tile)
        if quantization == "fp8" and name not in arrays:  # the rows quantized once, by their whole maximum
            q, scale = arrays[name + QUANT_SUFFIX], arrays[name + SCALE_SUFFIX]
            xq, x_scale = quantize_activations(rows, 1, axis_name)
            out = grouped_matmul(xq, group_sizes, lambda x, e: fp8_matmul(x, q[e], scale[e], 1), out_width, jnp.float32)
            return (out * x_scale).astype(rows.dtype)
        return grouped_matmul(rows, group_sizes, expert_matmul(arrays, quantization, name), out_width)

    hidden = jax.nn.silu(grouped(rows, "gate_proj", width)) * grouped(rows, "up_proj", width)
    return combine(grouped(hidden, "down_proj", x.shape[1], split_axis), order, weights)


def _experts_and_width(arrays: dict[str, Array], name: str) -> tuple[int, int]:
    """`(E, F)` of the experts' weight `name` `[E, D, F]` as `arrays` holds it: plain or
    group-quantized `[E, D, F]`, or its per-channel quantized pair `[E, F, D]`."""
    if name in arrays:
        return arrays[name].shape[0], arrays[name].shape[-1]
    codes = arrays[name + QUANT_SUFFIX]
    return codes.shape[0], codes.shape[-1 if name + ZERO_SUFFIX in arrays else 1]


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

    def __init__(self, config: ModelConfig, params, parallel: TensorParallel | None = None, kernels: bool = False):
        params.declare(self, ("layers", "moe"))  # router [D, E], experts [E, D, F] / [E, F, D], shared ones
        self.moe = config.moe
        self.quantization, self.group_kernel = params.quantization, params.group_kernel  # (shared expert)
        self.shared_expert = hasattr(self, "shared_expert_gate")
        self.parallel = parallel
        self.kernels = kernels  # the Pallas grouped-matmul kernel (with the Pallas attention backend)
        specs = [find_state_param(config, ("layers", "moe", w)).spec for w in ("gate_proj", "up_proj", "down_proj")]
        variants = [
            quantized_paths(config, s) if self.quantization is not None and s.quantize else (s.path,) for s in specs
        ]
        self.expert_names = tuple(path[-1] for paths in variants for path in paths)  # the arrays of the experts

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        weights, experts = route(x, self.router[...], self.moe)
        arrays = {name: getattr(self, name)[...] for name in self.expert_names}
        ffn = functools.partial(experts_ffn, quantization=self.quantization, top_k=self.moe.top_k, kernels=self.kernels)
        if self.parallel is None:
            out = ffn(arrays, x=x, weights=weights, experts=experts)
        else:
            out = on_every_device(self.parallel, ffn, arrays, x, weights, experts)
        if self.shared_expert:
            shared = project(self, "shared_gate_proj", x)
            shared = project(self, "shared_down_proj", jax.nn.silu(shared) * project(self, "shared_up_proj", x))
            out = out + jax.nn.sigmoid(x @ self.shared_expert_gate[...])[:, None] * shared
        return out


def on_every_device(parallel: TensorParallel, ffn, arrays: dict[str, Array], x, weights, experts):
    """`ffn` on every device over its share of the experts' weights (`shard_map`; the tokens and
    their routing are whole on every device), the devices' partial outputs summed: each holds
    a slice of every expert's FFN width, or, under expert parallelism, whole experts (those from
    `axis_index * E_local`); rows routed elsewhere are not computed there."""
    layout = parallel.layout
    specs = {
        name: PartitionSpec(*layout.mesh_axes(find_state_param(layout.config, ("layers", "moe", name)).axes[1:]))
        for name in arrays
    }

    def local(arrays, x, weights, experts):
        first, split_axis = 0, TENSOR_AXIS  # each device a share of every expert's FFN width
        if layout.expert_parallel:  # or whole experts
            first, split_axis = jax.lax.axis_index(TENSOR_AXIS) * next(iter(arrays.values())).shape[0], None
        out = ffn(arrays, x=x, weights=weights, experts=experts, first_expert=first, split_axis=split_axis)
        return jax.lax.psum(out, TENSOR_AXIS)

    whole = PartitionSpec()
    return jax.shard_map(
        local, mesh=parallel.mesh, in_specs=(specs, whole, whole, whole), out_specs=whole, check_vma=False
    )(arrays, x, weights, experts)


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
