"""Per-layer arrays for the unrolled decoder layers.

The layers' parameters are stacked (`[L, ...]`, see llama.py). A scan over the layers reads one
layer's slice per iteration; unrolled layers would slice a stacked array L times in every step,
and XLA on a CPU copies each slice before the matmuls that read it. So for unrolled layers the
runner splits every stacked parameter once, at start-up, into `LayerArrays`: layer l's weights are
an array of their own, and the step program indexes a Python tuple instead of slicing.
"""

from collections.abc import Callable

import jax

from jaxpaged.parallel.mesh import param_path
from jaxpaged.parallel.sharding import LAYER_STACK


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


def unstack_layers(state, layer_sharding: Callable[[tuple[str, ...]], jax.sharding.Sharding]):
    """`state` (placed arrays, or `jax.ShapeDtypeStruct`s) with every stacked layer parameter
    split into `LayerArrays`, each array placed with `layer_sharding(path)` (one layer's share).
    The stacked arrays are released once nothing else holds them."""

    def split(path, x):
        path = param_path(path)
        if not path or path[0] != LAYER_STACK:
            return x
        sharding = layer_sharding(path)
        if isinstance(x, jax.ShapeDtypeStruct):
            return LayerArrays(jax.ShapeDtypeStruct(x.shape[1:], x.dtype, sharding=sharding) for _ in range(x.shape[0]))
        return LayerArrays(jax.device_put(x[i], sharding) for i in range(x.shape[0]))

    return jax.tree_util.tree_map_with_path(split, state)
