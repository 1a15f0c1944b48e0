"""Every Pallas kernel lowers for CUDA (Pallas -> Triton IR) with real model shapes, on a CPU.

This catches primitives the Triton lowering does not support (float8 loads and casts included),
non-power-of-two tiles and bad shapes without a GPU; only a GPU run (`benchmarks/kernels_gpu.py`) catches wrong results on the
GPU and speed. The target GPU is described with an abstract device: jax 0.11 requires it (it
reads the compute capability from `device_kind`); jax 0.10.2 accepts it and otherwise assumes
sm_90. `interpret=False` is forced, since the CPU default would be the interpreter.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from jaxpaged.model.grouped_matmul import num_tiles, tile_rows
from pallas_kernels import group_quant_matmul, grouped_matmul, paged_decode_attention, ragged_paged_attention, write_kv

pytestmark = [
    pytest.mark.lowering,
    # jax 0.11 warns at every Triton lowering (the Triton backend is deprecated upstream).
    pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning"),
]

TRITON_CALL = "__gpu$xla.gpu.triton"
BLOCK_SIZE = 16
NUM_BLOCKS = 8192  # 131,072 tokens: a realistic per-layer pool on an 80 GB GPU
MAX_PAGES = 8192 // BLOCK_SIZE  # block tables sized for max_model_len 8K

# name -> (query heads N, kv heads K, head_dim H)
MODELS = {
    "llama-3.1-8b": (32, 8, 128),
    "llama-3.1-70b": (64, 8, 128),
    "llama-3.2-1b": (32, 8, 64),
    "head-dim-256": (16, 4, 256),
}


CUDA_DEVICE = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")


def lower_for_cuda(fn, *abstract_args, **abstract_kwargs) -> str:
    """StableHLO text of `jax.jit(fn)` lowered for CUDA on whatever machine runs the test."""
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=CUDA_DEVICE)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.jit(fn).trace(*abstract_args, **abstract_kwargs).lower(lowering_platforms=("cuda",)).as_text()


def sds(shape, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype)


def pools(kv_heads, head_dim, dtype=jnp.bfloat16):
    shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
    return sds(shape, dtype), sds(shape, dtype)


FLOAT8 = {"e4m3fn": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_decode_lowers_to_triton(model, batch):
    n, k, h = MODELS[model]
    fn = functools.partial(paged_decode_attention, interpret=False)
    text = lower_for_cuda(
        fn, sds((batch, n, h)), *pools(k, h), sds((batch, MAX_PAGES), jnp.int32), sds((batch,), jnp.int32)
    )
    assert TRITON_CALL in text


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize(
    "num_tokens,num_seqs",
    [(256, 256), (2048, 64), (8192, 1), (8192, 256)],
    ids=["decode-256", "mixed-2048", "prefill-8192", "mixed-8192"],
)
def test_ragged_lowers_to_triton(model, num_tokens, num_seqs):
    n, k, h = MODELS[model]
    fn = functools.partial(ragged_paged_attention, interpret=False)
    text = lower_for_cuda(
        fn,
        sds((num_tokens, n, h)),
        *pools(k, h),
        sds((num_seqs + 1,), jnp.int32),
        sds((num_seqs,), jnp.int32),
        sds((num_seqs, MAX_PAGES), jnp.int32),
        sds((), jnp.int32),
    )
    assert TRITON_CALL in text


@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_traced_sliding_windows_lower_to_triton(kernel):
    """Gemma-3-1b's heads (4 query heads, 1 kv head, head_dim 256), the layer's window traced."""
    window = sds((), jnp.int32)
    if kernel == "decode":
        fn = functools.partial(paged_decode_attention, interpret=False)
        args = (sds((64, 4, 256)), *pools(1, 256), sds((64, MAX_PAGES), jnp.int32), sds((64,), jnp.int32))
    else:
        fn = functools.partial(ragged_paged_attention, interpret=False)
        args = (sds((2048, 4, 256)), *pools(1, 256), sds((65,), jnp.int32), sds((64,), jnp.int32))
        args += (sds((64, MAX_PAGES), jnp.int32), sds((), jnp.int32))
    assert TRITON_CALL in lower_for_cuda(fn, *args, window=window)


def test_tiles_override_reaches_the_triton_call():
    """`tiles=` sets the Triton call's warps, stages and (through the rows) its grid."""
    n, k, h = MODELS["llama-3.1-8b"]
    seqs = 64
    ragged = (sds((2048, n, h)), *pools(k, h), sds((seqs + 1,), jnp.int32), sds((seqs,), jnp.int32))
    ragged += (sds((seqs, MAX_PAGES), jnp.int32), sds((), jnp.int32))
    default = lower_for_cuda(functools.partial(ragged_paged_attention, interpret=False), *ragged)
    tuned = lower_for_cuda(functools.partial(ragged_paged_attention, interpret=False, tiles=(64, 32, 4, 3)), *ragged)
    # 128 rows = 32 tokens x 4 heads: 2048 / 32 + 64 sequences' partial blocks = 128 programs; 64 rows: 192
    assert "num_warps = 8 : i32" in default and "num_stages = 2 : i32" in default and "grid_x = 128 :" in default
    assert "num_warps = 4 : i32" in tuned and "num_stages = 3 : i32" in tuned and "grid_x = 192 :" in tuned
    decode = (sds((8, n, h)), *pools(k, h), sds((8, MAX_PAGES), jnp.int32), sds((8,), jnp.int32))
    tuned = lower_for_cuda(functools.partial(paged_decode_attention, interpret=False, tiles=(64, 8, 3)), *decode)
    assert "num_warps = 8 : i32" in tuned and "num_stages = 3 : i32" in tuned


@pytest.mark.parametrize("quant", list(FLOAT8.values()), ids=list(FLOAT8))
@pytest.mark.parametrize("model", list(MODELS))
def test_float8_pools_lower_to_triton(model, quant):
    """float8 pools, bfloat16 queries, per-kv-head scales: fp8 loads and fp8 -> bf16 casts
    (`tt.fp_to_fp`, named in the Triton module's bytecode) lower. Triton's float8_e4m3fn casts
    need sm_89+; the abstract device is an H100."""
    n, k, h = MODELS[model]
    scales = dict(k_scale=sds((k,), jnp.float32), v_scale=sds((k,), jnp.float32))
    decode = functools.partial(paged_decode_attention, interpret=False)
    text = lower_for_cuda(
        decode,
        sds((64, n, h)),
        *pools(k, h, quant),
        sds((64, MAX_PAGES), jnp.int32),
        sds((64,), jnp.int32),
        **scales,
    )
    assert TRITON_CALL in text and "fp_to_fp" in text
    ragged = functools.partial(ragged_paged_attention, interpret=False)
    text = lower_for_cuda(
        ragged,
        sds((2048, n, h)),
        *pools(k, h, quant),
        sds((65,), jnp.int32),
        sds((64,), jnp.int32),
        sds((64, MAX_PAGES), jnp.int32),
        sds((), jnp.int32),
        **scales,
    )
    assert TRITON_CALL in text and "fp_to_fp" in text


# (x dtype, codes, group size, tokens, K, N): Llama-3.1-8B's gate/up, down and k/v projections, in
# decode steps (one row block, K split) and a 256-sequence decode and a 2,048-token prefill (64- and
# 128-row blocks).
GROUP_MATMULS = {
    "int4-gate-16": (jnp.bfloat16, jnp.int4, 128, 16, 4096, 14336),
    "int4-down-64": (jnp.float16, jnp.int4, 128, 64, 14336, 4096),
    "int4-q-256": (jnp.bfloat16, jnp.int4, 128, 256, 4096, 4096),
    "int4-gate-2048": (jnp.bfloat16, jnp.int4, 128, 2048, 4096, 14336),
    "int4-down-2000": (jnp.bfloat16, jnp.int4, 128, 2000, 14336, 4096),
    "int8-kv-1-g32": (jnp.float32, jnp.int8, 32, 1, 4096, 1024),
}


@pytest.mark.parametrize("case", list(GROUP_MATMULS))
def test_group_quant_matmul_lowers_to_triton(case):
    """4-bit codes read two per byte (int8 loads, shifts, int -> float casts) and 8-bit codes lower."""
    dtype, codes, group_size, tokens, num_in, num_out = GROUP_MATMULS[case]
    groups = num_in // group_size
    fn = functools.partial(group_quant_matmul, interpret=False)
    text = lower_for_cuda(
        fn,
        sds((tokens, num_in), dtype),
        sds((num_in, num_out), codes),
        sds((groups, num_out), jnp.float32),
        sds((groups, num_out), jnp.int8),
    )
    assert TRITON_CALL in text


@pytest.mark.parametrize("quant", [None, jnp.float8_e4m3fn], ids=["bf16", "e4m3fn"])
def test_write_kv_lowers_for_cuda_as_an_in_place_scatter(quant):
    """write_kv is an XLA scatter (no Triton call); donated, its outputs alias the pools, float8
    pools (written quantised from bfloat16 K/V) included."""
    _, k, h = MODELS["llama-3.1-8b"]
    fn = jax.jit(functools.partial(write_kv, quant_dtype=quant), donate_argnums=(0, 1))
    scales = {} if quant is None else dict(k_scale=sds((k,), jnp.float32), v_scale=sds((k,), jnp.float32))
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=CUDA_DEVICE)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = fn.trace(
            *pools(k, h, quant or jnp.bfloat16),
            sds((2048, k, h)),
            sds((2048, k, h)),
            sds((2048,), jnp.int32),
            **scales,
        ).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "scatter" in text and TRITON_CALL not in text
    assert text.count("tf.aliasing_output") == 2, "both pools must be donated into the outputs"


@pytest.mark.parametrize("rows", [16, 1024], ids=["decode-8-tokens", "prefill-512-tokens"])
@pytest.mark.parametrize("weight_shape", [(8, 4096, 14336), (8, 14336, 4096)], ids=["gate-up", "down"])
def test_grouped_matmul_lowers_to_triton_at_mixtral_shapes(rows, weight_shape):
    """Mixtral-8x7B's experts (top-2): 8 or 512 tokens' routed rows in their tile schedule."""
    num_experts = weight_shape[0]
    tile = tile_rows(rows, num_experts)
    tiles = sds((num_tiles(rows, num_experts, tile),), jnp.int32)
    fn = functools.partial(grouped_matmul, tile=tile, interpret=False)
    text = lower_for_cuda(fn, sds((rows, weight_shape[1])), sds(weight_shape), tiles, tiles, tiles)
    assert TRITON_CALL in text
