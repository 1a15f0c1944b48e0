"""The engine's whole step program (model on the Pallas kernels + sampler) lowers for CUDA on a CPU.

Lowering the kernels alone (test_kernel_lowering.py) does not prove the programs the engine
compiles on a GPU lower too: the fused decode steps sit inside `lax.scan`, next to the sampler's
sort and top-k, and under tensor parallelism inside `shard_map`. Here the real step
programs are lowered for CUDA with Llama-3.1-8B's attention shapes (2 layers to keep it quick)
and the Triton calls of both kernels must be in them. On a CPU the kernels would default to
interpret mode, so the tests trace inside `pallas_kernels.compiling_for("gpu")`, as on a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from test_kernel_lowering import CUDA_DEVICE, TRITON_CALL, lower_for_cuda

import pallas_kernels
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.functional import DeviceCache, init_cache
from jaxpaged.model import KVPool, Llama
from jaxpaged.model.sampler import SamplerOptions
from jaxpaged.parallel.mesh import TensorParallel, param_path
from jaxpaged.parallel.sharding import TensorParallelLayout
from jaxpaged.worker.step_packer import StepPacker
from jaxpaged.worker.step_programs import _fused_decode_steps, _model_program

pytestmark = [
    pytest.mark.lowering,
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

NUM_BLOCKS = 4096
LLAMA_8B_2_LAYERS = ModelConfig(
    architecture="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=2,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
)


@pytest.fixture(autouse=True)
def for_a_gpu():
    """Traces as for a GPU: the kernels compiled, not interpreted."""
    with pallas_kernels.compiling_for("gpu"):
        yield


@pytest.fixture
def abstract_engine():
    model = nnx.eval_shape(
        lambda: Llama(LLAMA_8B_2_LAYERS, jnp.bfloat16, rngs=nnx.Rngs(0), attention="pallas", scan_layers=True)
    )
    graphdef, params = nnx.split(model)
    cache = jax.eval_shape(
        lambda: init_cache(
            LLAMA_8B_2_LAYERS,
            num_blocks=NUM_BLOCKS,
            block_size=16,
            dtype=jnp.bfloat16,
            max_num_seqs=64,
            platform="cuda",
        )
    )
    packer = StepPacker(
        block_size=16,
        max_model_len=4096,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        vocab_size=LLAMA_8B_2_LAYERS.vocab_size,
    )
    return graphdef, params, cache, packer


def test_mixed_step_lowers_with_the_ragged_and_decode_kernels(abstract_engine):
    graphdef, params, cache, packer = abstract_engine
    layout = packer.layouts[512]
    flat = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
    text = lower_for_cuda(functools.partial(_model_program, layout, False, False, graphdef), params, cache, flat)
    # Two Triton calls in the one (scanned) layer body, both run every step: the decode kernel for
    # the step's leading decode rows and the ragged kernel for the rest (mixed_attention.py), no
    # `lax.cond` between them; the runner picks the decode program for decode batches.
    assert text.count(TRITON_CALL) == 2
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    assert_no_pool_sized_conversion(text)


def test_fused_decode_steps_lower_with_the_decode_kernel(abstract_engine):
    graphdef, params, cache, packer = abstract_engine
    layout = packer.layouts[packer.bucket_for(64, 64)]
    flat = jax.ShapeDtypeStruct((layout.size,), jnp.int32)
    text = lower_for_cuda(
        functools.partial(_fused_decode_steps, layout, 4, SamplerOptions(), False, graphdef), params, cache, flat
    )
    assert text.count(TRITON_CALL) == 1  # the decode kernel, in the layer body of the step body
    assert_no_pool_sized_conversion(text)


def assert_no_pool_sized_conversion(text: str) -> None:
    """The bfloat16 pool is read in place: no pool-shaped array of another dtype is ever made
    (a per-step float32 copy of a layer's pool is the defect tests/test_pool_size.py guards on CPU)."""
    c = LLAMA_8B_2_LAYERS
    blocks = NUM_BLOCKS * c.num_layers  # every layer's blocks in one pool
    pool = f"{blocks}x16x{c.num_kv_heads}x{c.head_dim}"
    assert f"tensor<{pool}xbf16>" in text, "the pools should be bfloat16 on CUDA"
    shapes = {f"{pool}x{dtype}" for dtype in ("f32", "f16", "i16", "ui16")} | {
        f"{blocks * 16}x{c.num_kv_heads}x{c.head_dim}xf32"
    }
    assert not [s for s in shapes if f"tensor<{s}>" in text], "a pool-sized array of another dtype is built"


@pytest.fixture
def abstract_two_gpu_engine():
    """The 8B-shaped engine split over two abstract H100s: sharded parameter, pool and input specs."""
    # Auto axes, as the engine's concrete mesh has (jax 0.11 makes abstract meshes Explicit by default)
    mesh = jax.sharding.AbstractMesh(
        (2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=CUDA_DEVICE
    )
    parallel = TensorParallel(TensorParallelLayout(LLAMA_8B_2_LAYERS, 2), mesh)
    model = nnx.eval_shape(
        lambda: Llama(
            LLAMA_8B_2_LAYERS, jnp.bfloat16, rngs=nnx.Rngs(0), attention="pallas", parallel=parallel, scan_layers=True
        )
    )
    graphdef, params = nnx.split(model)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=parallel.param_sharding(param_path(path))),
        params,
    )
    cache = jax.eval_shape(
        lambda: init_cache(
            LLAMA_8B_2_LAYERS,
            num_blocks=NUM_BLOCKS,
            block_size=16,
            dtype=jnp.bfloat16,
            max_num_seqs=64,
            platform="cuda",
        )
    )
    whole, pool = parallel.sharding(), parallel.pool_sharding

    def placed(x, sharding):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    cache = DeviceCache(
        kv=KVPool(k=placed(cache.kv.k, pool), v=placed(cache.kv.v, pool), num_layers=cache.kv.num_layers),
        prompt_mask=placed(cache.prompt_mask, whole),
        output_counts=placed(cache.output_counts, whole),
        last_tokens=placed(cache.last_tokens, whole),
    )
    packer = StepPacker(
        block_size=16,
        max_model_len=4096,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        vocab_size=LLAMA_8B_2_LAYERS.vocab_size,
    )
    return mesh, graphdef, params, cache, packer, whole


@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "fused-decode"])
def test_tensor_parallel_steps_lower_with_the_kernels_under_shard_map(abstract_two_gpu_engine, decode):
    """Each GPU runs the kernels on its 4 of the 8 kv heads: the Triton calls sit inside the
    manual (shard_map) computations and see a [L * NB, BS, 4, H] pool. The all-reduces after o_proj
    and down_proj are added when XLA partitions the program, which compiling for CUDA (a GPU)
    would show; cross-lowering only shows the vocabulary-parallel embedding's psum."""
    mesh, graphdef, params, cache, packer, whole = abstract_two_gpu_engine
    layout = packer.layouts[packer.bucket_for(64, 64) if decode else 512]
    flat = jax.ShapeDtypeStruct((layout.size,), jnp.int32, sharding=whole)
    step_fn = (
        functools.partial(_fused_decode_steps, layout, 4, SamplerOptions(), False, graphdef)
        if decode
        else functools.partial(_model_program, layout, False, False, graphdef)
    )
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(step_fn).trace(params, cache, flat).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert text.count(TRITON_CALL) == (1 if decode else 2)  # in the one (scanned) layer body
    assert text.count("sdy.manual_computation") >= 3  # the layer body's write and attention, the embedding
    assert f"tensor<{NUM_BLOCKS * LLAMA_8B_2_LAYERS.num_layers}x16x4x128xbf16>" in text  # one GPU's share of the pool
    assert "all_reduce" in text
