"""Checks that a checkpoint loaded under tensor parallelism lands in its shards (shared by the
tensor-parallel and the FP8 checkpoint tests)."""

import jax
import numpy as np
from flax import nnx

from jaxpaged.checkpoint.loader import load_model
from jaxpaged.parallel.mesh import param_path


def check_loaded_into_shards(sources, parallel, single, assert_same) -> None:
    """Loads each of `sources` (model directories) on `parallel`'s mesh and checks every leaf:
    split as the sharding table says, holding the values of `single` (the model loaded on one
    device) in the mesh layout; `assert_same(actual, expected, message)` compares values."""
    reference = dict(jax.tree_util.tree_flatten_with_path(nnx.state(single))[0])
    for source in sources:
        _, model = load_model(source, "float32", parallel=parallel, scan_layers=True)
        leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
        assert len(leaves) == len(reference)
        for path, leaf in leaves:
            name = param_path(path)
            assert leaf.sharding.is_equivalent_to(parallel.param_sharding(name), leaf.ndim), (source, name)
            assert_same(leaf, parallel.to_mesh_layout(name, np.asarray(reference[path])), f"{source}: {name}")
