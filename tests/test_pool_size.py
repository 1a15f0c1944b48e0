"""A step costs the same whatever the KV pool size: no program's temporaries grow with the pool.

XLA's CPU backend gathers bfloat16 only after converting the gathered operand to float32, and
the operand of a page gather is a layer's whole pool: a bfloat16 pool made every step copy every
layer's pool (1 GiB of temporaries for a 512 MiB pool, per-token time x36). The pool is stored
in float32 on CPU for such dtypes (jaxpaged/model/kv_pool.py). Here every program the runner
compiles, in every dtype and on both attention paths, is compiled with a small and a 20x larger
pool and must report the same temporaries. The CUDA-lowered programs are checked for
pool-sized conversions in test_step_lowering.py (compiling for CUDA needs a GPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.model import Llama, init_kv_pool, kv_storage_dtype
from jaxpaged.worker.model_runner import ModelRunner

# head_dim 64: the smallest the Pallas kernels take.
CONFIG = ModelConfig(architecture="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=64)  # fmt: skip
SMALL, LARGE = 20, 400  # pool blocks
TOLERANCE = 4096  # bytes: alignment noise; one pool block is 32 KiB here


def temporaries(dtype, backend: str, num_blocks: int) -> dict:
    model = Llama(CONFIG, dtype, rngs=nnx.Rngs(0), attention=backend)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    runner = ModelRunner(model, mesh=mesh, num_blocks=num_blocks, block_size=16, max_num_seqs=4,
                         max_num_batched_tokens=32, max_model_len=128, kv_dtype=dtype, num_decode_steps=4)  # fmt: skip
    for program in runner.programs():
        runner.compile_bucket(*program)
    return runner.temp_bytes


@pytest.mark.parametrize("backend", ["reference", "pallas"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=lambda d: jnp.dtype(d).name)
def test_no_program_temporaries_grow_with_the_pool(dtype, backend):
    small, large = temporaries(dtype, backend, SMALL), temporaries(dtype, backend, LARGE)
    assert set(small) == set(large) and len(small) >= 3  # token buckets 16 and 32, fused decode
    grown = {p: (small[p], large[p]) for p in small if abs(large[p] - small[p]) > TOLERANCE}
    assert not grown, f"temporaries (small pool, large pool) grow with the pool: {grown}"


def test_cpu_stores_bfloat16_pools_in_float32():
    assert kv_storage_dtype(jnp.bfloat16, "cpu") == jnp.float32
    assert kv_storage_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16
    assert kv_storage_dtype(jnp.bfloat16, "cuda") == jnp.bfloat16
    assert kv_storage_dtype(jnp.float16, "cpu") == jnp.float16  # gathered natively
    assert kv_storage_dtype(jnp.float32, "cpu") == jnp.float32
    pool = init_kv_pool(CONFIG, 4, 16, jnp.bfloat16, "cpu")
    assert pool.k[0].dtype == jnp.float32 and pool.k[0].shape == (4, 16, 2, 64)


def test_bfloat16_pool_in_float32_holds_exact_bfloat16_values():
    """What the model writes (bfloat16 projections) round-trips exactly through the float32 pool,
    so results equal those of a bfloat16 pool."""
    from pallas_kernels import reference

    k = jax.random.normal(jax.random.key(0), (8, 2, 64), jnp.bfloat16)
    pool = init_kv_pool(CONFIG, 4, 16, jnp.bfloat16, "cpu")
    k_pool, _ = reference.write_kv(pool.k[0], pool.v[0], k, k, jnp.arange(16, 24))
    assert k_pool.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(k_pool.reshape(-1, 2, 64)[16:24].astype(jnp.bfloat16)), np.asarray(k))
