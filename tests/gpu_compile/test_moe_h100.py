"""A mixture of experts' step programs as an H100 runs them (deviceless compilation, see
test_h100_programs.py): the experts' matmuls are tiles of the routed rows, never a product of
every row with every expert, and nothing waits on the host (the tile loops have known trip
counts). Plain (bf16) experts go through the Pallas grouped-matmul kernel, three per layer, which
reads each tile's expert weight in place: no program slices one expert's `[1, D, F]` out of the
stack (the copy XLA's tile loop makes for every tile); fp8 experts keep XLA's tile loops. `jax.lax.ragged_dot`, which jaxpaged does not use, is checked to still become that
dense product: the reason for the tiles (when XLA stops expanding it, this test says so).
"""

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding
from test_h100_programs import assert_no_host_waits, compile_for_h100, model_dir

from jaxpaged.bench.gpu_targets import compiling_for_target

D, F, E = 256, 512, 8
TINY_MIXTRAL = dict(
    hidden_size=D,
    intermediate_size=F,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    vocab_size=512,
    max_position_embeddings=2048,
    num_local_experts=E,
)


def reads_every_expert_at_once(text: str) -> bool:
    """Whether a dot of optimised HLO takes the whole `[E, D, F]` stack of an expert weight as one
    operand (in any layout: `[E, D, F]`, `[E * D, F]`, ...), as the dense all-experts product does
    (a tile reads one expert's `[D, F]`)."""
    for computation in text.split("\n\n"):
        if re.search(r"\} dot\(", computation):
            for shape in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} parameter\(", computation):
                if math.prod(int(d) for d in shape.split(",") if d) == E * D * F:
                    return True
    return False


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(dtype="bfloat16"), id="bfloat16"),
        pytest.param(dict(dtype="bfloat16", quantization="fp8"), id="fp8-weights"),
        pytest.param(dict(dtype="bfloat16", tensor_parallel_size=2, enable_expert_parallel=True), id="expert-parallel"),
    ],
)
def test_h100_programs_multiply_tiles_of_routed_rows(tmp_path, options):
    compiled, _ = compile_for_h100(model_dir(tmp_path, "mixtral-8x7b", **TINY_MIXTRAL), 64 * 2**20, **options)
    assert_no_host_waits(compiled)
    one_expert = re.compile(rf"bf16\[1,({D},{F}|{F},{D})\]")  # one expert's weight sliced out of [E, ...]
    for program, executable in compiled.items():
        text = executable.as_text()
        assert not reads_every_expert_at_once(text), f"{program}: a dense all-experts product"
        kernels = len(re.findall(r'op_name="[^"]*/grouped_matmul/pallas_call"', text))
        if "quantization" in options:
            assert kernels == 0 and len(re.findall(r"\bwhile\(", text)) >= 3 * 2, f"{program}: the tile loops"
        else:
            assert kernels == 3 * 2, f"{program}: {kernels} grouped-matmul kernels, not 3 a layer"
            assert not one_expert.search(text), f"{program}: an expert's weight copied out for a tile"


def test_ragged_dot_still_becomes_a_dense_all_experts_product():
    def ragged(x, w, sizes):
        return jax.lax.ragged_dot(x, w, sizes)

    with compiling_for_target("h100", 1) as devices:
        on = SingleDeviceSharding(devices[0])
        args = (
            jax.ShapeDtypeStruct((128, D), jnp.bfloat16, sharding=on),
            jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16, sharding=on),
            jax.ShapeDtypeStruct((E,), jnp.int32, sharding=on),
        )
        text = jax.jit(ragged).trace(*args).lower(lowering_platforms=("cuda",)).compile().as_text()
    assert reads_every_expert_at_once(text)
