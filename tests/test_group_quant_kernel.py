"""`pallas_kernels.group_quant_matmul` (interpret mode on CPU) equals a float64 product with the
dequantized weight and XLA's `group_matmul`; `group_matmul(kernel=True)` runs it, and the model asks
for it on a GPU without tensor parallelism.

The data would break a wrong kernel: codes over their whole range, zero points drawn independently
of the codes (asymmetric, anywhere in the code range) and scales differing per group and column, so
a swapped nibble, a wrong group, a column off by one or a lost split changes the result. Output
widths are not multiples of the kernel's column block; a K of an odd number of tiles splits
unequally; token counts above one row block end in a partial block (64- and 128-row blocks).
Shapes stay small: the interpreter runs every program one after another.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from jaxpaged.config.hf_config import model_config_from_hf
from jaxpaged.config.presets import get_preset
from jaxpaged.model.group_quant import group_matmul
from jaxpaged.model.llama import group_kernel_parallel, use_group_kernel
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.parallel.pipeline import PipelineLayout
from pallas_kernels import group_quant_matmul, quant_matmul

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def random_weight(rng, num_in: int, num_out: int, group_size: int, bits: int, code_dtype):
    """`(codes [K, N] in code_dtype, scale [G, N] float32, zero [G, N] int8)` and the float64 weight
    they mean, `(codes - zero) * scale`."""
    groups, low, high = num_in // group_size, -(2 ** (bits - 1)), 2 ** (bits - 1)
    codes = rng.integers(low, high, (num_in, num_out))
    zero = rng.integers(low, high, (groups, num_out))
    scale = rng.uniform(0.001, 0.02, (groups, num_out)).astype(np.float32)
    w = (codes - np.repeat(zero, group_size, axis=0)) * np.repeat(scale.astype(np.float64), group_size, axis=0)
    arrays = jnp.asarray(codes, code_dtype), jnp.asarray(scale), jnp.asarray(zero, jnp.int8)
    return arrays, w


def rel_error(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# (x dtype, bits, code dtype, group size, T, K, N): every x dtype, both code dtypes at 4 bits (int4
# packed two per byte on a GPU; int8, a CPU's storage) and 8 bits, group sizes below, at and above
# the kernel's 128-row tile; token counts in one row block (up to 64) and in several 64-row (65,
# 200, 1000) or 128-row (1100) blocks, the last partly padding.
CASES = [
    (jnp.float32, 4, jnp.int4, 32, 5, 96, 202),
    (jnp.bfloat16, 4, jnp.int8, 16, 1, 64, 70),
    (jnp.float16, 8, jnp.int8, 128, 16, 256, 64),
    (jnp.bfloat16, 4, jnp.int4, 256, 33, 512, 130),
    (jnp.float32, 8, jnp.int8, 128, 3, 2176, 24),  # 17 tiles in 2 splits (9 and 8)
    (jnp.float32, 4, jnp.int4, 128, 2, 4096, 10),  # int4 in 2 splits, summed in XLA
    (jnp.bfloat16, 4, jnp.int4, 16, 63, 32, 134),
    (jnp.float32, 4, jnp.int4, 32, 65, 64, 130),  # 2 row blocks, the second 1 row
    (jnp.bfloat16, 8, jnp.int8, 16, 200, 48, 70),
    (jnp.float32, 8, jnp.int8, 32, 1000, 32, 24),
    (jnp.bfloat16, 4, jnp.int4, 16, 1100, 32, 20),  # 9 blocks of 128 rows
]


@pytest.mark.parametrize(
    "dtype,bits,code_dtype,group_size,num_tokens,num_in,num_out",
    CASES,
    ids=[f"{jnp.dtype(c[0]).name}-{c[1]}bit-{jnp.dtype(c[2]).name}-g{c[3]}-t{c[4]}" for c in CASES],
)
def test_kernel_matches_float64_and_xla(dtype, bits, code_dtype, group_size, num_tokens, num_in, num_out):
    rng = np.random.default_rng(group_size * 100 + num_tokens)
    (codes, scale, zero), w = random_weight(rng, num_in, num_out, group_size, bits, code_dtype)
    x = jnp.asarray(rng.standard_normal((num_tokens, num_in)), dtype)
    out = jax.jit(lambda *a: group_quant_matmul(*a, interpret=True))(x, codes, scale, zero)
    assert out.shape == (num_tokens, num_out) and out.dtype == dtype
    ref = np.asarray(x, np.float64) @ w
    assert rel_error(out, ref) < TOLERANCE[dtype]
    xla = group_matmul(x, codes.astype(jnp.int8), scale, zero, 1)  # XLA's path (int8 on a CPU)
    assert rel_error(out, xla) < TOLERANCE[dtype]


def test_a_long_k_is_split():
    """The 2176- and 4096-input cases above run in two programs along K (`num_splits`), one column
    block."""
    assert quant_matmul.num_splits(1, 17, 16, 2176, 8) == 2
    assert quant_matmul.num_splits(1, 32, 16, 4096, 4) == 2


def test_row_blocks_grow_with_the_step():
    """A decode step's tokens in one row block; larger steps in 64-, then 128-row blocks (8 warps),
    never splitting K at Llama-3.1-8B's widths (the result written in x's dtype)."""
    assert [quant_matmul.row_block(t)[0] for t in (1, 16, 17, 64, 65, 256, 1023, 1024, 2048)] == [
        16,
        16,
        32,
        64,
        64,
        64,
        64,
        128,
        128,
    ]
    assert quant_matmul.row_block(2048)[1] == 8
    for tokens, num_in in ((256, 4096), (2048, 4096), (2048, 14336)):
        rows = -(-tokens // quant_matmul.row_block(tokens)[0]) * quant_matmul.row_block(tokens)[0]
        assert quant_matmul.num_splits(32 * rows // 64, num_in // 128, rows, num_in, 4) == 1


@pytest.mark.parametrize(
    "codes_shape,code_dtype,groups,match",
    [
        ((64, 33), jnp.int4, 2, "33 outputs"),
        ((96, 32), jnp.int8, 2, "group_size=48"),
        ((64, 32), jnp.int16, 2, "int16"),
        ((64, 32), jnp.int8, 3, r"codes \[64, 32\]"),
    ],
    ids=["odd-int4-width", "group-size", "code-dtype", "shapes"],
)
def test_unsupported_weights_are_clear_errors(codes_shape, code_dtype, groups, match):
    num_in, num_out = codes_shape
    with pytest.raises(ValueError, match=match):
        group_quant_matmul(
            jnp.zeros((2, num_in), jnp.float32),
            jnp.zeros(codes_shape, code_dtype),
            jnp.ones((groups, num_out), jnp.float32),
            jnp.zeros((groups, num_out), jnp.int8),
            interpret=True,
        )


def test_group_matmul_takes_the_kernel_for_every_step():
    """`kernel=True`: multi-axis weights `[*in, *out]` (an o_proj's `[N, H, D]`) and act-order
    inputs through the kernel for a decode step's tokens and a prefill's (more than the group
    size, where XLA's product would widen the weight), XLA's product for a group size the kernel
    refuses; the same results either way."""
    rng = np.random.default_rng(7)
    (codes, scale, zero), _ = random_weight(rng, 64, 48, 16, 4, jnp.int8)
    codes = codes.reshape(4, 16, 48)  # [N, H, D]: two input axes
    perm = jnp.asarray(rng.permutation(64), jnp.int32)
    for tokens in (3, 100):
        x = jnp.asarray(rng.standard_normal((tokens, 4, 16)), jnp.float32)
        run = lambda x, kernel: group_matmul(x, codes, scale, zero, 2, perm, kernel=kernel)  # noqa: E731
        assert "pallas_call" in str(jax.make_jaxpr(run, static_argnums=1)(x, True))
        np.testing.assert_allclose(run(x, True), run(x, False), rtol=1e-5, atol=1e-5)
    refused = jnp.zeros((48, 8), jnp.int8), jnp.ones((2, 8), jnp.float32), jnp.zeros((2, 8), jnp.int8)  # groups of 24
    jaxpr = jax.make_jaxpr(lambda x: group_matmul(x, *refused, 1, kernel=True))(jnp.ones((2, 48)))
    assert "pallas_call" not in str(jaxpr)


def test_the_model_takes_the_kernel_on_a_gpu_on_one_device_or_every_devices_shard():
    """On a GPU: on one device (or one per pipeline stage), and under tensor parallelism on every
    device over its shard (`group_kernel_parallel`: a Pallas call under GSPMD would gather its
    operands whole); not with tensor and pipeline parallelism together."""
    config = model_config_from_hf(get_preset("llama-3.1-8b"))
    one, two = TensorParallel.create(config, 1), TensorParallel.create(config, 2)
    two_stages = TensorParallel.create(config, 2, pipeline=PipelineLayout(config.num_layers, 2))
    assert not use_group_kernel(None) and not use_group_kernel(one) and group_kernel_parallel(two) is None  # this CPU
    with pallas_kernels.compiling_for("gpu"):
        assert use_group_kernel(None) and use_group_kernel(one) and use_group_kernel(two)
        assert group_kernel_parallel(one) is None and group_kernel_parallel(two) is two
        assert not use_group_kernel(two_stages) and group_kernel_parallel(two_stages) is None
