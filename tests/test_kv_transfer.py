"""Host-tier copies on the device (jaxpaged.worker.kv_transfer): blocks of every layer gathered
into host slots and scattered back bit for bit, in every pool dtype, on one device and split over
kv heads (also repeated ones), in calls of every size and nothing else touched; the copies update
the pool in place (their temporaries do not grow with the pool)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.core.host_tier import KVTransfers
from jaxpaged.functional import DeviceCache
from jaxpaged.model import KVPool, kv_storage_dtype
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.worker.kv_transfer import TRANSFER_SIZES, KVTransfer, transfer_chunks

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)
BS = 4


def setup(dtype, devices: int, num_blocks: int = 50, host_blocks: int = 80, seed: int = 0):
    parallel = TensorParallel.create(CONFIG, devices)
    mesh_config = parallel.layout.mesh_config
    shape = (CONFIG.num_layers * num_blocks, BS, mesh_config.num_kv_heads, CONFIG.head_dim)
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal(shape).astype(np.float32).astype(dtype) for _ in range(2))
    whole = parallel.sharding()
    shardings = DeviceCache(
        kv=KVPool(k=parallel.pool_sharding, v=parallel.pool_sharding, num_layers=CONFIG.num_layers),
        prompt_mask=whole,
        output_counts=whole,
        last_tokens=whole,
    )
    cache = DeviceCache(
        kv=KVPool(k=jnp.asarray(k), v=jnp.asarray(v), num_layers=CONFIG.num_layers),
        prompt_mask=jnp.zeros((2, 64), bool),
        output_counts=jnp.zeros((2, 64), jnp.int32),
        last_tokens=jnp.zeros(2, jnp.int32),
    )
    cache = jax.device_put(cache, shardings)
    transfer = KVTransfer(
        parallel,
        shardings,
        num_layers=CONFIG.num_layers,
        num_host_blocks=host_blocks,
        block_shape=shape[1:],
        dtype=dtype,
    )
    return transfer, cache, k, v


def layer_rows(block, num_blocks=50):
    return [layer * num_blocks + block for layer in range(CONFIG.num_layers)]


@pytest.mark.parametrize("devices", [1, 2, 4])  # 4: each of the 2 kv heads repeated on 2 devices
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_blocks_round_trip_bit_for_bit(dtype, devices):
    transfer, cache, k, v = setup(dtype, devices)
    rng = np.random.default_rng(1)
    blocks = rng.permutation(np.arange(1, 50))[:41].tolist()  # 41 = 16 + 16 + 4 + 4 + 1: every size but 64
    slots = rng.permutation(80)[:41].tolist()
    cache = transfer.run(cache, KVTransfers(list(zip(blocks, slots)), []))
    for block, slot in zip(blocks, slots):
        np.testing.assert_array_equal(transfer.host[slot, 0], k[layer_rows(block)])
        np.testing.assert_array_equal(transfer.host[slot, 1], v[layer_rows(block)])
    # Load them back shifted by one block: block b gets what block b-1's slot holds.
    targets = [b - 1 if b > 1 else 49 for b in blocks]
    cache = transfer.run(cache, KVTransfers([], list(zip(slots, targets))))
    k_after, v_after = np.asarray(cache.kv.k), np.asarray(cache.kv.v)
    expect_k, expect_v = k.copy(), v.copy()
    for block, target in zip(blocks, targets):
        expect_k[layer_rows(target)] = k[layer_rows(block)]
        expect_v[layer_rows(target)] = v[layer_rows(block)]
    np.testing.assert_array_equal(k_after, expect_k)  # the null blocks and every other block untouched
    np.testing.assert_array_equal(v_after, expect_v)
    assert cache.kv.k.sharding.spec == TensorParallel.create(CONFIG, devices).pool_sharding.spec


def test_copies_are_cut_into_calls_without_padding():
    assert TRANSFER_SIZES == (64, 16, 4, 1)
    assert transfer_chunks(57) == [16, 16, 16, 4, 4, 1] and transfer_chunks(0) == []
    assert transfer_chunks(200) == [64, 64, 64, 4, 4]
    for n in range(300):
        assert sum(transfer_chunks(n)) == n


def test_offload_lands_in_host_memory_where_the_devices_have_it():
    transfer, cache, _, _ = setup(np.float32, 1)
    assert transfer.memory_kind == "pinned_host"  # the CPU backend has it too
    offloaded = transfer._offload(cache.kv, jnp.zeros(4, jnp.int32))
    assert offloaded.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_load_updates_the_pool_in_place(dtype, devices):
    """In the dtype the pool is stored in on this platform (see `kv_storage_dtype`)."""
    temps = []
    for num_blocks in (20, 400):
        transfer, cache, _, _ = setup(kv_storage_dtype(dtype), devices, num_blocks=num_blocks)
        temps.append([lower().compile().memory_analysis().temp_size_in_bytes for _, lower in transfer.lower(cache)])
    block_bytes = 2 * CONFIG.num_layers * BS * CONFIG.num_kv_heads * CONFIG.head_dim * 4
    for small, large in zip(*temps):
        assert large - small < block_bytes, temps
