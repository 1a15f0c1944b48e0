"""One pipeline tick (pipeline parallelism): every stage runs its layer slots over the
micro-batch at it, then the activations move on one stage. `Llama._pipelined` runs a step's
micro-batches through M + P - 1 of these ticks; `Llama.pipeline_tick` runs one, carrying the
micro-batches in flight from one call to the next (`PipelineCarry`). Both run `tick`.

Dimension letters: P stages, Tm tokens of a micro-batch, D hidden, S sequence rows, W pages.
"""

import dataclasses
import typing
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Bool, Float

from jaxpaged.model.kv_pool import KVPool
from jaxpaged.model.layer_arrays import LayerArrays
from jaxpaged.model.metadata import AttentionMetadata
from jaxpaged.parallel.pipeline import PipelineLayout
from jaxpaged.parallel.sharding import PIPELINE_AXIS


@typing.no_type_check  # JAX rebuilds pytrees from non-array leaves (ArgInfo, specs)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PipelineCarry:
    """The micro-batches in flight between two ticks.

    Attributes:
      hidden: `[P, Tm, D]` row s: the activations entering stage s at the next tick (zeros where
        `busy` is False). Row 0 is always empty between ticks: the next tick's entering
        micro-batch takes it.
      meta: `AttentionMetadata` stacked `[P, ...]` (every field one row per stage; `decode_only`
        one for all): row s is the micro-batch at stage s, as it entered. An empty row's
        metadata is stale or zeros; it is never used to write.
      busy: `[P]` whether stage s holds a micro-batch. The only record of it: an empty stage
        runs its layers with `with_no_writes` metadata and its result is dropped.

    Kept on device between programs, `hidden` is best split over the pipeline axis (the shift
    to the next stage is then one collective permute) and `meta` and `busy` whole on every
    device (each stage reads its row; shifting them moves nothing between devices).
    """

    hidden: Float[Array, "P Tm D"]
    meta: AttentionMetadata
    busy: Bool[Array, " P"]


def empty_carry(stages: int, hidden_size: int, dtype, meta: AttentionMetadata) -> PipelineCarry:
    """A carry with no micro-batch in flight, for micro-batches shaped as `meta` (its `[Tm]`
    tokens, sequence rows, pages and `decode_only`); its metadata is zeros (no sequence)."""
    num_tokens = meta.positions.shape[0]
    zeros = jax.tree.map(lambda a: jnp.zeros((stages, *a.shape), a.dtype), meta)
    return PipelineCarry(
        hidden=jnp.zeros((stages, num_tokens, hidden_size), dtype), meta=zeros, busy=jnp.zeros((stages,), bool)
    )


def _is_layer_arrays(x) -> bool:
    return isinstance(x, LayerArrays)


class Stages:
    """The decoder's stages as one function run on every stage's shards (`shard_map`, manual
    over the pipeline axis only; tensor parallelism inside is XLA's as everywhere else): a
    stage holds only its slice of each layer slot array `[P, ...]` and of the pool
    `[P * slots * NB, ...]`, and updates its pool in place. (A `vmap` over the stage axis
    computes the same, but XLA copied the pool into every step around the per-head `shard_map`s
    inside it.)

    Args:
      pipe: the stages' layers.
      mesh: the `[pp, tp]` mesh.
      layer: one decoder layer, `layer((x, k, v), params, first_block, kv_quant, meta) -> (x, k, v)`
        (`llama._one_layer` with the layers' graphdef and the pool's block size; jitted, so it
        is traced once).
      layer_params: the layers' parameters, each a `LayerArrays` of slot arrays `[P, ...]`.
      kv_pool: the pool (its block count and fp8 scales; its arrays travel through `run`).
    """

    def __init__(self, pipe: PipelineLayout, mesh: Mesh, layer: Callable, layer_params, kv_pool: KVPool):
        self.size, self.slots = pipe.size, pipe.max_layers
        self.pool_shape = kv_pool.k.shape
        num_blocks = kv_pool.num_blocks
        quant = None if kv_pool.quant is None else jax.tree.map(self._by_stage, kv_pool.quant)
        slot_params = [jax.tree.map(lambda a: a[j], layer_params, is_leaf=_is_layer_arrays) for j in range(self.slots)]
        counts = jnp.asarray(pipe.layers_per_stage, jnp.int32)
        uneven = len(set(pipe.layers_per_stage)) > 1

        def stage(x, k, v, slot_params, meta, quant, count):
            for j in range(self.slots):
                kv_quant = None if quant is None else jax.tree.map(lambda a: a[j], quant)
                new_x, k, v = layer((x, k, v), slot_params[j], j * num_blocks, kv_quant, meta)
                x = jnp.where(j < count, new_x, x) if uneven else new_x  # an empty slot passes x on
            return x, k, v

        def local(*args):  # one stage's shard of each argument: its leading stage axis of 1 dropped
            out = stage(*jax.tree.map(lambda a: a[0], args))
            return jax.tree.map(lambda a: a[None], out)

        by_stages = PartitionSpec(PIPELINE_AXIS)
        run = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=by_stages,
            out_specs=by_stages,
            axis_names=frozenset({PIPELINE_AXIS}),
            check_vma=False,
        )
        self._whole = NamedSharding(mesh, PartitionSpec())
        self._run = lambda x, k, v, meta: run(x, k, v, slot_params, meta, quant, counts)

    def _by_stage(self, a):  # [P * n, ...] -> [P, n, ...]: the axis split over the stages, no copy
        return a.reshape(self.size, a.shape[0] // self.size, *a.shape[1:])

    def split_pool(self, kv_pool: KVPool) -> tuple[Array, Array]:
        """The pool's K and V as `[P, slots * NB, BS, K, H]`: each stage's blocks in its row."""
        return self._by_stage(kv_pool.k), self._by_stage(kv_pool.v)

    def join_pool(self, kv_pool: KVPool, k: Array, v: Array) -> KVPool:
        """`kv_pool` holding `split_pool`'s K and V after the ticks."""
        return dataclasses.replace(kv_pool, k=k.reshape(self.pool_shape), v=v.reshape(self.pool_shape))

    def run(self, x: Float[Array, "P Tm D"], k, v, meta: AttentionMetadata, busy: Bool[Array, " P"]):
        """Every stage over its row of `x` and `meta`; a stage not `busy` writes no K/V (its
        tokens' slots all the null block: `AttentionMetadata.with_no_writes`). Returns
        `(x, k, v)`."""
        # Whole on every device (as the step's inputs arrive), so each stage takes its row where
        # it is. Left to itself XLA split the stacked metadata over the tensor axis and moved it
        # with an all-to-all per field and tick (19 in a decode step at TP 2 x PP 2 for an H100).
        meta = jax.lax.with_sharding_constraint(meta.with_no_writes(~busy), self._whole)
        return self._run(x, k, v, meta)


def tick(
    stages: Stages,
    carry: PipelineCarry,
    x: Float[Array, "Tm D"],
    meta: AttentionMetadata,
    entering,
    k: Array,
    v: Array,
) -> tuple[Float[Array, "Tm D"], Bool[Array, ""], PipelineCarry, Array, Array]:
    """One tick: the micro-batch `x` (embedded) with `meta` enters stage 0 when `entering` (a
    bool, Python or traced; else stage 0 idles), every stage s > 0 runs on the carried
    micro-batch, the activations move on one stage.

    Returns:
      The last stage's output (not final-normed; zeros when the last stage was empty), whether a
      micro-batch left the last stage, the next carry, and the pool's K and V (`split_pool`'s).

    Raises:
      ValueError: `x` or `meta` is not shaped as the carry's micro-batches.
    """
    _check_fits(carry, x, meta)
    inputs = carry.hidden.at[0].set(x.astype(carry.hidden.dtype))
    metas = jax.tree.map(lambda rows, new: rows.at[0].set(new), carry.meta, meta)
    busy = carry.busy.at[0].set(jnp.asarray(entering, bool))
    out, k, v = stages.run(inputs, k, v, metas, busy)
    exited = busy[-1]
    # Stage s's micro-batch goes to stage s + 1: every row shifted by one, not rotated (the last
    # stage's output would go to stage 0 for nothing). Row 0 stays empty; its metadata is stale.
    following = _shift(busy, jnp.zeros_like(busy[:1]))
    moved = jnp.where(following[:, None, None], _shift(out, jnp.zeros_like(out[:1])), jnp.zeros_like(out))
    nxt = PipelineCarry(hidden=moved, meta=jax.tree.map(lambda a: _shift(a, a[:1]), metas), busy=following)
    return jnp.where(exited, out[-1], jnp.zeros_like(out[-1])), exited, nxt, k, v


def _shift(rows: Array, first: Array) -> Array:
    """`rows` `[P, ...]` moved one row on, `first` in row 0 (split over the stages: a collective
    permute from each stage to the next; whole on every device: a local copy)."""
    return jnp.concatenate([first, rows[:-1]])


def _check_fits(carry: PipelineCarry, x, meta: AttentionMetadata) -> None:
    if x.shape != carry.hidden.shape[1:]:
        raise ValueError(
            f"the entering micro-batch's activations are {x.shape}, the carry's micro-batches "
            f"{carry.hidden.shape[1:]}: every micro-batch of a carry has as many tokens"
        )
    if meta.decode_only != carry.meta.decode_only:
        raise ValueError(
            f"an entering micro-batch with decode_only={meta.decode_only} into a carry of "
            f"decode_only={carry.meta.decode_only} micro-batches: the stages run one attention "
            "kernel; give every micro-batch the ragged form (decode_only=False) to mix them"
        )
    for name in ("positions", "cu_q_lens", "kv_lens", "block_tables"):
        got, want = getattr(meta, name).shape, getattr(carry.meta, name).shape[1:]
        if got != want:
            raise ValueError(
                f"the entering micro-batch's {name} is {got}, the carry's micro-batches' {want}: "
                "every micro-batch of a carry has the same shapes (pad them to one bucket)"
            )
