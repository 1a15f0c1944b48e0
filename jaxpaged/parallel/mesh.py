"""The sharding table applied to JAX: the device mesh, parameter and pool placement, and the
per-head / per-vocabulary-shard computations of a tensor-parallel step.

`TensorParallel` is hashable (the model keeps it as static structure): layers call
`per_head` around the pool write and the attention, `embed` for the embedding lookup and `replicate` on the
logits the sampler reads; with one device each is the plain computation.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.spec import EXPERTS, LAYER_STACK
from jaxpaged.parallel.pipeline import PipelineLayout
from jaxpaged.parallel.sharding import (
    KV_HEADS,
    KV_POOL_AXES,
    MESH_AXES,
    STAGES,
    TENSOR_AXIS,
    VOCAB,
    TensorParallelError,
    TensorParallelLayout,
)


def make_mesh(tensor_parallel_size: int, devices: list | None = None, pipeline_parallel_size: int = 1) -> Mesh:
    """A `[pp, tp]` mesh of the first `pipeline_parallel_size * tensor_parallel_size` devices (all
    processes' devices, in order): stage s is the s-th run of `tensor_parallel_size` devices, so
    with one process per host and a host's devices per stage, the pipeline axis spans the hosts.

    Raises:
      TensorParallelError: fewer devices than asked for, with the count.
    """
    devices = jax.devices() if devices is None else devices
    needed = tensor_parallel_size * pipeline_parallel_size
    if needed > len(devices):
        sizes = f"tensor_parallel_size={tensor_parallel_size}"
        if pipeline_parallel_size > 1:
            sizes += f" x pipeline_parallel_size={pipeline_parallel_size}"
        raise TensorParallelError(
            f"{sizes} needs {needed} devices, but JAX sees {len(devices)} ({devices[0].platform} devices)"
        )
    grid = np.array(devices[:needed]).reshape(pipeline_parallel_size, tensor_parallel_size)
    # Auto axes: XLA propagates the parameters' shardings through the step (the per-head parts
    # are explicit shard_maps), whatever a JAX version's default axis type is.
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """A model's sharding table on a concrete mesh.

    Args:
      layout: how the model splits (`TensorParallelLayout`).
      mesh: the devices; its `TENSOR_AXIS` size is `layout.size`. An `AbstractMesh` (devices
        described, not present) serves to lower the step programs for another platform.
    """

    layout: TensorParallelLayout
    mesh: Mesh | AbstractMesh

    @classmethod
    def create(
        cls,
        config: ModelConfig,
        tensor_parallel_size: int = 1,
        devices: list | None = None,
        pipeline: PipelineLayout | None = None,
    ) -> "TensorParallel":
        """Validates the split (`TensorParallelLayout`) and builds the mesh."""
        layout = TensorParallelLayout(config, tensor_parallel_size, pipeline=pipeline)
        return cls(layout, make_mesh(tensor_parallel_size, devices, layout.pipeline.size))

    @property
    def size(self) -> int:
        return self.layout.size

    @property
    def platform(self) -> str:
        if isinstance(self.mesh, AbstractMesh):
            return self.mesh.abstract_device.platform
        return self.mesh.devices.flat[0].platform

    def sharding(self, mesh_axes: tuple[str | None, ...] = (), memory_kind: str | None = None) -> NamedSharding:
        """The `NamedSharding` of mesh axes per dimension (empty: replicated), in the devices'
        memory, or in `memory_kind` (e.g. "pinned_host")."""
        return NamedSharding(self.mesh, PartitionSpec(*mesh_axes), memory_kind=memory_kind)

    def logical_sharding(self, axes: tuple[str | None, ...], memory_kind: str | None = None) -> NamedSharding:
        """The sharding of an array with these logical axes (see the sharding table)."""
        return self.sharding(self.layout.mesh_axes(axes), memory_kind)

    @property
    def pinned_host(self) -> str | None:
        """ "pinned_host" where the mesh's devices can address pinned host memory, else None."""
        if isinstance(self.mesh, AbstractMesh):
            return None
        kinds = {m.kind for m in self.mesh.devices.flat[0].addressable_memories()}
        return "pinned_host" if "pinned_host" in kinds else None

    def param_sharding(self, path: tuple[str, ...]) -> NamedSharding:
        """Where the parameter at `path` (its string keys, see `param_path`) lives."""
        return self.sharding(self.layout.param_mesh_axes(path))

    def layer_sharding(self, path: tuple[str, ...]) -> NamedSharding:
        """Where one layer's slice of the stacked parameter at `path` lives; under pipeline
        parallelism one layer slot's array `[P, ...]` (each stage's layer on its stage)."""
        axes = self.layout.param_axes(path)[1:]
        return self.logical_sharding((STAGES, *axes) if self.layout.pipeline.size > 1 else axes)

    def stage_sharding(self, path: tuple[str, ...], stage: int) -> NamedSharding:
        """Where one layer of stage `stage` lives before its slot array is assembled: `[1, ...]`
        on that stage's devices only, split like the layer (see `place_layer`)."""
        stage_mesh = Mesh(self.mesh.devices[stage : stage + 1], MESH_AXES, axis_types=self.mesh.axis_types)
        return NamedSharding(stage_mesh, PartitionSpec(None, *self.layout.param_mesh_axes(path)[1:]))

    def place_layer(self, path: tuple[str, ...], array: np.ndarray, layer: int) -> jax.Array:
        """Puts decoder layer `layer`'s tensor of the per-layer parameter at `path` on its devices:
        `place(..., one_layer=True)`, or under pipeline parallelism `[1, ...]` on its stage's
        devices only (`stage_sharding`; `stack_stages` assembles the slots)."""
        if self.layout.pipeline.size == 1:
            return self.place(path, array, one_layer=True)
        array = self.to_mesh_layout(path, array, one_layer=True)[None]
        sharding = self.stage_sharding(path, self.layout.pipeline.stage_of(layer))
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index], dtype=array.dtype)

    @property
    def local_layers(self) -> frozenset[int] | None:
        """The decoder layers of the pipeline stages that have a device in this process (the
        only ones it reads from a checkpoint); None: every layer (no pipeline, or every stage
        here)."""
        pipe = self.layout.pipeline
        here = jax.process_index()
        stages = [s for s in range(pipe.size) if any(d.process_index == here for d in self.mesh.devices[s])]
        if len(stages) == pipe.size:
            return None
        return frozenset(layer for s in stages for layer in pipe.stage_ranges[s])

    def stack_stages(self, path: tuple[str, ...], layers: list[jax.Array | None]) -> list[jax.Array]:
        """The layer slot arrays `[P, ...]` of a per-layer parameter from its layers placed by
        `place_layer` (None: a layer of another process's stage, not read here), each slot
        assembled from its stages' layers where they lie (no copy); an empty slot's share is
        zeros made on its stage."""
        pipe = self.layout.pipeline
        if pipe.size == 1:
            return layers
        some = next(layer for layer in layers if layer is not None)
        slots = []
        for slot in range(pipe.max_layers):
            parts = []
            for stage in range(pipe.size):
                layer = pipe.layer_at(stage, slot)
                if layer is None:  # zeros where this process holds the stage's devices (no program runs)
                    zeros = np.broadcast_to(np.zeros((), some.dtype), some.shape)
                    sharding = self.stage_sharding(path, stage)
                    parts.append(
                        jax.make_array_from_callback(some.shape, sharding, lambda i: zeros[i], dtype=some.dtype)
                    )
                elif layers[layer] is not None:
                    parts.append(layers[layer])
            shape = (pipe.size, *some.shape[1:])
            shards = [shard.data for part in parts for shard in part.addressable_shards]
            slots.append(jax.make_array_from_single_device_arrays(shape, self.layer_sharding(path), shards))
        return slots

    def restore_sharding(self, path: tuple[str, ...]) -> NamedSharding:
        """Where a converted checkpoint's tensor at `path` is restored (each device reads its
        part): `param_sharding`, except a stacked per-layer parameter `[L, ...]` under pipeline
        parallelism whose stages hold equally many layers: its layer axis is split over the
        stages, so each stage reads only its own layers (`slots_of_stack` then cuts the slots
        where they lie). With unequal stages every stage restores every layer (its TP shard)
        first: a contiguous unequal split is not a sharding."""
        pipe = self.layout.pipeline
        if pipe.size == 1 or path[0] != LAYER_STACK or len(set(pipe.layers_per_stage)) > 1:
            return self.param_sharding(path)
        return self.logical_sharding((STAGES, *self.layout.param_axes(path)[1:]))

    def slots_of_stack(self, path: tuple[str, ...], stacked: jax.Array) -> list[jax.Array]:
        """The layer slot arrays `[P, ...]` of a stacked per-layer parameter `[L, ...]` restored
        in `restore_sharding`, each device cutting its stage's layer out of its own shard (no
        transfer, across processes too); an empty slot's share is zeros."""
        pipe = self.layout.pipeline
        out = self.layer_sharding(path)
        if stacked.sharding.is_equivalent_to(self.param_sharding(path), stacked.ndim):  # every layer on every stage
            rows = [[pipe.layer_at(s, j) for s in range(pipe.size)] for j in range(pipe.max_layers)]

            def slot(x, j):
                picked = x[jnp.asarray([0 if r is None else r for r in rows[j]])]
                live = np.array([r is not None for r in rows[j]]).reshape(-1, *[1] * (x.ndim - 1))
                return jnp.where(live, picked, jnp.zeros((), x.dtype))

        else:  # the layer axis split over equal stages: slot j of stage s is its j-th row

            def slot(x, j):
                return x.reshape(pipe.size, pipe.max_layers, *x.shape[1:])[:, j]

        cut = jax.jit(slot, static_argnums=1, out_shardings=out)
        return [cut(stacked, j) for j in range(pipe.max_layers)]

    @property
    def pool_sharding(self) -> NamedSharding:
        return self.sharding(self.layout.mesh_axes(KV_POOL_AXES))

    def reshapes(self, path: tuple[str, ...]) -> bool:
        """Whether the parameter's checkpoint tensor differs from its mesh layout (kv heads
        repeated onto more devices, or experts spread over slots with empty ones)."""
        axes = self.layout.param_axes(path)
        return (self.layout.kv_replicas > 1 and KV_HEADS in axes) or (
            bool(self.layout.empty_expert_slots) and EXPERTS in axes
        )

    def to_mesh_layout(self, path: tuple[str, ...], array, *, one_layer: bool = False):
        """A checkpoint tensor (numpy or jax) in the mesh layout: its kv-head axis, if any,
        repeated `kv_replicas` times (each head next to the devices whose query heads read it);
        its experts' axis, if any, spread over the expert slots, zeros in the empty ones.

        Args:
          one_layer: `array` is one layer's slice of the stacked parameter at `path`.
        """
        if not self.reshapes(path):
            return array
        axes = self.layout.param_axes(path)[1 if one_layer else 0 :]
        xp = np if isinstance(array, np.ndarray) else jnp
        if KV_HEADS in axes and self.layout.kv_replicas > 1:
            array = xp.repeat(array, self.layout.kv_replicas, axis=axes.index(KV_HEADS))
        if EXPERTS in axes and self.layout.empty_expert_slots:
            moe = self.layout.mesh_config.moe
            axis = axes.index(EXPERTS)
            slots = xp.zeros((*array.shape[:axis], moe.num_slots, *array.shape[axis + 1 :]), array.dtype)
            at = (slice(None),) * axis + (np.array(moe.expert_slots),)
            if xp is np:
                slots[at] = array
            else:
                slots = slots.at[at].set(array)
            array = slots
        return array

    def place(self, path: tuple[str, ...], array: np.ndarray, *, one_layer: bool = False) -> jax.Array:
        """Puts one checkpoint tensor (our layout, checkpoint kv heads) on the mesh; each device
        receives only its shard (of several processes, each places its own devices' shards).

        Args:
          one_layer: `array` is one layer's slice of the stacked parameter at `path`.
        """
        array = self.to_mesh_layout(path, array, one_layer=one_layer)
        sharding = self.layer_sharding(path) if one_layer else self.param_sharding(path)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    # -- inside a step ------------------------------------------------------------------------

    def per_head(self, fn, in_axes: tuple, out_axes):
        """`fn` run on every device over its own heads (and, for axes split over the stages, its
        stage's share: e.g. `KV_POOL_AXES`) (`shard_map`); `fn` itself where nothing is split.

        Args:
          fn: a function of arrays (or pytrees of them).
          in_axes, out_axes: the logical axes of each argument / of the result (as in the table,
            e.g. `KV_POOL_AXES`); `()` for a pytree that is whole on every device.
        """

        def spec(axes):
            return PartitionSpec(*self.layout.mesh_axes(axes))

        out_specs = tuple(map(spec, out_axes)) if isinstance(out_axes[0], tuple) else spec(out_axes)
        in_specs = tuple(map(spec, in_axes))
        if not any(a is not None for s in (*in_specs, *jax.tree.leaves(out_specs)) for a in s):
            return fn
        return jax.shard_map(fn, mesh=self._context_mesh(), in_specs=in_specs, out_specs=out_specs, check_vma=False)

    def _context_mesh(self):
        """The mesh a `shard_map` inside a step names: this mesh, or inside a stage of the
        pipeline (a `shard_map` manual over the pipeline axis) the context's abstract mesh."""
        context = jax.sharding.get_abstract_mesh()
        return context if not context.empty and context.manual_axes else self.mesh

    def embed(self, table: jax.Array, token_ids: jax.Array) -> jax.Array:
        """`table[token_ids]` of a `[V, D]` table split over the vocabulary: each device looks up
        the ids in its rows (zeros elsewhere) and one all-reduce sums them (exact: one term is
        non-zero)."""
        if self.layout.mesh_axes((VOCAB,)) == (None,):
            return table[token_ids]

        def lookup(rows, ids):
            first = jax.lax.axis_index(TENSOR_AXIS) * rows.shape[0]
            local = ids - first
            hit = (local >= 0) & (local < rows.shape[0])
            found = rows[jnp.where(hit, local, 0)]
            return jax.lax.psum(jnp.where(hit[:, None], found, jnp.zeros_like(found)), TENSOR_AXIS)

        return jax.shard_map(
            lookup,
            mesh=self._context_mesh(),
            in_specs=(PartitionSpec(TENSOR_AXIS, None), PartitionSpec()),
            out_specs=PartitionSpec(),
            check_vma=False,
        )(table, token_ids)

    def vocab_split(self, x: jax.Array) -> jax.Array:
        """`x [..., V]` (logits) kept split over the vocabulary as the LM head, split so, computes
        it: pinned before `replicate`, it makes XLA gather the logits rather than the head (a
        replicated result alone let it all-gather the whole `[D, V]` head in every step: 1 GiB
        of temporaries for Llama-3.1-8B at TP 2)."""
        axis = self.layout.mesh_axes((VOCAB,))[0]
        if self.size == 1 or axis is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding((None,) * (x.ndim - 1) + (axis,)))

    def replicate(self, x: jax.Array) -> jax.Array:
        """`x` whole on every device (e.g. logits split over the vocabulary, for the sampler)."""
        if self.size == 1:
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding())


def param_path(path) -> tuple[str, ...]:
    """The parameter path of a state leaf as the sharding table reads it: its string keys, e.g.
    `("layers", "attn", "q_proj")` (`nnx.State` paths end in the Variable's value, dropped)."""
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return tuple(n for n in names if isinstance(n, str) and n != "value")


def bytes_per_device(tree) -> dict:
    """Bytes of every array of `tree` on each device (shards counted where they live)."""
    out: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + math.prod(shard.data.shape) * leaf.dtype.itemsize
    return out
