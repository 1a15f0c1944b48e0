"""Per-layer arrays for the unrolled decoder layers.

A scan over the layers reads one layer's slice of a stacked parameter (`[L, ...]`) per iteration;
unrolled layers would slice a stacked array L times in every step, and XLA on a CPU copies each
slice before the matmuls that read it. So a model with unrolled layers holds each per-layer
parameter as `LayerArrays` from the start (llama.py creates them so, the loader fills them layer
by layer): layer l's weights are an array of their own, and the step program indexes a Python
tuple instead of slicing. Only a checkpoint restored whole (Orbax) comes stacked, and is split
once (`unstack_layers`).
"""

from collections.abc import Callable

import jax

from jaxpaged.config.params.spec import LAYER_STACK
from jaxpaged.parallel.mesh import param_path


@jax.tree_util.register_pytree_node_class
class LayerArrays:
    """One stacked parameter as its L per-layer arrays: `layer_arrays[l]` is layer l's array."""

    def __init__(self, arrays):
        self.arrays = tuple(arrays)

    def __getitem__(self, layer: int):
        return self.arrays[layer]

    def tree_flatten(self):
        return self.arrays, None

    @classmethod
    def tree_unflatten(cls, _, arrays):
        return cls(arrays)


def unstack_layers(state, layer_sharding: Callable[[tuple[str, ...]], jax.sharding.Sharding], *, release: bool = False):
    """`state` (placed arrays, or `jax.ShapeDtypeStruct`s) with every stacked layer parameter
    split into `LayerArrays`, each array placed with `layer_sharding(path)` (one layer's share).
    Parameters already split stay as they are.

    Args:
      release: delete each stacked array as soon as it is split (the caller owns them), so the
        device never holds two copies of every weight; else they go once nothing holds them.
    """

    def split(path, x):
        path = param_path(path)
        if not path or path[0] != LAYER_STACK or isinstance(x, LayerArrays):
            return x
        sharding = layer_sharding(path)
        if isinstance(x, jax.ShapeDtypeStruct):
            return LayerArrays(jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding) for _ in range(x.shape[0]))
        layers = LayerArrays(jax.device_put(x[i], sharding) for i in range(x.shape[0]))
        if release:
            x.delete()
        return layers

    return jax.tree_util.tree_map_with_path(split, state, is_leaf=lambda x: isinstance(x, LayerArrays))


def state_shardings(state, parallel):
    """The table sharding of every array of a model state, one layer's for each of a
    `LayerArrays`' arrays (for `jit` out_shardings, or shapes placed nowhere)."""

    def sharding(path, x):
        path = param_path(path)
        if isinstance(x, LayerArrays):
            return LayerArrays(parallel.layer_sharding(path) for _ in x.arrays)
        return parallel.param_sharding(path)

    return jax.tree_util.tree_map_with_path(sharding, state, is_leaf=lambda x: isinstance(x, LayerArrays))


def place_params(state, parallel):
    """`state` on the mesh of `parallel` (a `TensorParallel`), each array with its table sharding,
    each of a `LayerArrays`' arrays with one layer's (no copy where an array is there already)."""

    def place(path, x):
        path = param_path(path)
        if isinstance(x, LayerArrays):
            sharding = parallel.layer_sharding(path)
            return LayerArrays(jax.device_put(a, sharding) for a in x.arrays)
        return jax.device_put(x, parallel.param_sharding(path))

    return jax.tree_util.tree_map_with_path(place, state, is_leaf=lambda x: isinstance(x, LayerArrays))
