"""Sleep mode (vLLM's meaning): the runner gives its device memory back and takes it again.

    level 1   the weights are copied to host memory, the KV pool and penalty tables are dropped
    level 2   the weights and the pool are dropped (nothing kept); waking needs new weights
              (`update_weights`) or the checkpoint read again (`reload_weights`)

"Dropped" means the runner lets go of its arrays: their device memory is freed once nothing else
holds them (a trainer that shares its arrays with the engine keeps its own alive). While asleep
the runner holds, in place of each array, its shape, dtype and sharding (`jax.ShapeDtypeStruct`),
which is what new weights are checked against.
"""

import dataclasses

import jax
import numpy as np

LEVELS = (1, 2)


@dataclasses.dataclass
class Slept:
    """What a sleeping runner keeps.

    Attributes:
      level: 1 or 2.
      host_params: level 1: the parameter state with host (numpy) arrays, else None.
      kv_scales: an fp8 pool's per-layer `(k_scale [L], v_scale [L])` (None: no fp8 pool).
    """

    level: int
    host_params: object | None
    kv_scales: tuple[np.ndarray, np.ndarray] | None


def abstract(tree):
    """Every array of `tree` as its shape, dtype and sharding."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def is_abstract(tree) -> bool:
    """Whether any leaf of `tree` is a shape only (weights dropped by sleep level 2)."""
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def check_level(level: int) -> None:
    """Raises ValueError for a level other than 1 or 2."""
    if level not in LEVELS:
        raise ValueError(f"sleep level={level!r} must be 1 (weights to host memory) or 2 (weights discarded)")


def keep(params, cache, level: int) -> Slept:
    """What a runner going to sleep at `level` must keep of its `params` and `cache` (see the
    module docstring); the runner then drops them (`ModelRunner.sleep`).

    Raises:
      ValueError: a level other than 1 or 2.
    """
    check_level(level)
    quant = cache.kv.quant
    scales = None if quant is None else (np.asarray(quant.k_scale)[:, 0], np.asarray(quant.v_scale)[:, 0])
    host = jax.tree.map(np.asarray, params) if level == 1 else None
    return Slept(level, host, scales)


def restore(host_params, abstract_params):
    """Level 1's host copy of the weights back on the devices, each with its sharding."""
    return jax.tree.map(lambda h, s: jax.device_put(h, s.sharding), host_params, abstract_params)
