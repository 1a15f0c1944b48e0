"""Copies of whole KV blocks between the device pool and host memory (the host tier's slots).

The host tier (`jaxpaged.core.host_tier`) plans the copies; this module carries them out before
each step, offloads first, then loads:

- offload: one program gathers C blocks' K and V of every layer into `[C, 2, L, BS, K, H]` (one
  block's data contiguous, as it is kept on the host), written straight into pinned host memory
  where the devices have it (JAX memory kinds), else into device memory and then fetched; the
  host copies it into the blocks' slots.
- load: the slots' data is gathered on the host into one `[C, 2, L, BS, K, H]` buffer, put on
  the devices in one transfer, and one program scatters it into the pool (donated: in place).

A copy of n blocks is cut into calls of C in `TRANSFER_SIZES`, largest first (57 blocks:
16 + 16 + 16 + 4 + 4 + 1), so nothing is padded: every byte moved is a block's.

Dimension letters: C blocks per copy, L layers, BS block size,
K kv heads (all of them: under tensor parallelism each device copies its own heads, and the host
holds the whole block), H head_dim.
"""

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxpaged.core.host_tier import KVTransfers
from jaxpaged.functional import DeviceCache
from jaxpaged.model import KVPool
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.parallel.sharding import KV_BLOCK_AXES, KV_POOL_AXES

logger = logging.getLogger("jaxpaged")

# Blocks moved by one program call, largest first (one program per size and direction).
TRANSFER_SIZES = (64, 16, 4, 1)


def transfer_chunks(n: int) -> list[int]:
    """The call sizes that move `n` blocks: as many of the largest size as fit, then the next."""
    chunks = []
    for size in TRANSFER_SIZES:
        chunks += [size] * (n // size)
        n %= size
    return chunks


def _layer_rows(ids: Int[Array, " C"], num_layers: int, num_blocks: int) -> Int[Array, "C L"]:
    """Pool rows of blocks `ids` in every layer (layer l's blocks start at `l * NB`)."""
    return ids[:, None] + jnp.arange(num_layers, dtype=ids.dtype)[None, :] * num_blocks


def gather_blocks(
    k_pool: Float[Array, "LNB BS K H"], v_pool: Float[Array, "LNB BS K H"], ids: Int[Array, " C"], *, num_layers: int
) -> Float[Array, "C 2 L BS K H"]:
    """K and V of blocks `ids` in every layer, one block's data contiguous."""
    rows = _layer_rows(ids, num_layers, k_pool.shape[0] // num_layers)
    return jnp.stack([k_pool[rows], v_pool[rows]], axis=1)


def scatter_blocks(
    k_pool: Float[Array, "LNB BS K H"],
    v_pool: Float[Array, "LNB BS K H"],
    ids: Int[Array, " C"],
    data: Float[Array, "C 2 L BS K H"],
    *,
    num_layers: int,
):
    """The pools with blocks `ids` of every layer replaced by `data`."""
    rows = _layer_rows(ids, num_layers, k_pool.shape[0] // num_layers)
    return k_pool.at[rows].set(data[:, 0]), v_pool.at[rows].set(data[:, 1])


def _offload(parallel: TensorParallel, num_layers: int, kv: KVPool, ids):
    local = num_layers // parallel.layout.pipeline.size  # each stage copies its own layers' blocks
    gather = parallel.per_head(
        functools.partial(gather_blocks, num_layers=local), (KV_POOL_AXES, KV_POOL_AXES, ()), KV_BLOCK_AXES
    )
    return gather(kv.k, kv.v, ids)


def _load(parallel: TensorParallel, num_layers: int, cache: DeviceCache, ids, data) -> DeviceCache:
    scatter = parallel.per_head(
        functools.partial(scatter_blocks, num_layers=num_layers // parallel.layout.pipeline.size),
        (KV_POOL_AXES, KV_POOL_AXES, (), KV_BLOCK_AXES),
        (KV_POOL_AXES, KV_POOL_AXES),
    )
    k, v = scatter(cache.kv.k, cache.kv.v, ids, data)
    return dataclasses.replace(cache, kv=dataclasses.replace(cache.kv, k=k, v=v))  # an fp8 pool keeps its scales


class KVTransfer:
    """The host tier's memory and the two copy programs.

    Args:
      parallel: the mesh and sharding table.
      cache_shardings: where the cache lives (the load program's output).
      num_layers: L.
      num_host_blocks: host slots.
      block_shape: `(BS, K, H)` of one layer's block, K in the mesh layout (all devices' heads).
      dtype: the pool's storage dtype.
    """

    def __init__(
        self,
        parallel: TensorParallel,
        cache_shardings: DeviceCache,
        *,
        num_layers: int,
        num_host_blocks: int,
        block_shape: tuple[int, int, int],
        dtype,
    ):
        self.slot_shape = (2, num_layers, *block_shape)
        # np.empty: pages are only touched (and counted by the OS) as slots fill.
        self.host = np.empty((num_host_blocks, *self.slot_shape), dtype)
        self.memory_kind = parallel.pinned_host
        self._device = parallel.logical_sharding(KV_BLOCK_AXES)
        self._ids_sharding = parallel.sharding()
        out = parallel.logical_sharding(KV_BLOCK_AXES, self.memory_kind)
        self._offload = jax.jit(functools.partial(_offload, parallel, num_layers), out_shardings=out)
        self._load = jax.jit(
            functools.partial(_load, parallel, num_layers), donate_argnums=(0,), out_shardings=cache_shardings
        )
        self._compiled: dict[tuple[str, int], object] = {}  # (direction, size) -> executable

    @property
    def block_bytes(self) -> int:
        """Host bytes of one block (K and V of every layer)."""
        return int(np.prod(self.slot_shape)) * self.host.dtype.itemsize

    def lower(self, cache: DeviceCache) -> list[tuple[str, Callable[[], jax.stages.Lowered]]]:
        """`(name, lower)` of every program (both directions, every size), for the runner's warm-up."""
        jobs = []
        for size in TRANSFER_SIZES:
            ids = jax.ShapeDtypeStruct((size,), jnp.int32, sharding=self._ids_sharding)
            data = jax.ShapeDtypeStruct((size, *self.slot_shape), self.host.dtype, sharding=self._device)
            jobs.append((f"host tier offload, {size} blocks", lambda ids=ids: self._offload.lower(cache.kv, ids)))
            jobs.append(
                (f"host tier load, {size} blocks", lambda ids=ids, data=data: self._load.lower(cache, ids, data))
            )
        return jobs

    def set_compiled(self, executables: list) -> None:
        """Keeps the programs the warm-up compiled, in `lower`'s order (else `jit` compiles each at
        first use)."""
        for i, size in enumerate(TRANSFER_SIZES):
            self._compiled[("offload", size)], self._compiled[("load", size)] = executables[2 * i : 2 * i + 2]

    def run(self, cache: DeviceCache, transfers: KVTransfers) -> DeviceCache:
        """Carries out `transfers` (offloads, then loads); returns the cache with the loads in it."""
        start = 0
        for size in transfer_chunks(len(transfers.offloads)):
            chunk = transfers.offloads[start : start + size]
            start += size
            offload = self._compiled.get(("offload", size), self._offload)
            data = np.asarray(
                offload(cache.kv, self._ids([block for block, _ in chunk]))
            )  # waits: loads may reuse the slots
            self.host[[slot for _, slot in chunk]] = data
        start = 0
        for size in transfer_chunks(len(transfers.loads)):
            chunk = transfers.loads[start : start + size]
            start += size
            load = self._compiled.get(("load", size), self._load)
            data = jax.device_put(self.host[[slot for slot, _ in chunk]], self._device)  # a fresh host array
            cache = load(cache, self._ids([block for _, block in chunk]), data)
        return cache

    def _ids(self, blocks: list[int]) -> jax.Array:
        return jax.device_put(np.asarray(blocks, np.int32), self._ids_sharding)
