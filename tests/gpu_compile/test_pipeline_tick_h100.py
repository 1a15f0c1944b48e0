"""`Llama.pipeline_tick` as the carried pipeline's step program will run it on H100s (deviceless
compilation, see test_h100_programs.py): 2 stages of 2 GPUs, the carry and the pool donated, the
carry's activations split over the stages and its metadata whole on every GPU. The pool is
updated in place (aliased), the temporaries do not grow with it, nothing waits on the host, and
the only collectives over the stages move activations (no all-to-all of metadata), for decode
and ragged micro-batches alike.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from test_h100_programs import LARGE_POOL, SMALL_POOL, TOLERANCE, assert_no_host_waits, h100_engine_args, tiny_dir

from jaxpaged.bench.gpu_targets import compiling_for_target
from jaxpaged.bench.startup import abstract_worker
from jaxpaged.model import AttentionMetadata
from jaxpaged.model.pipeline_carry import empty_carry
from jaxpaged.parallel.sharding import PIPELINE_AXIS

TOKENS, PAGES = 16, 64  # a micro-batch's tokens; its block tables' width


def compile_tick(model: str, pool_bytes: int, decode: bool):
    """The tick (and the leaving micro-batch's logits) compiled for 4 H100s, 2 stages of 2; the
    carry's activations split over the stages, its metadata whole; it and the pool donated."""
    args = h100_engine_args(
        model,
        pool_bytes,
        max_num_batched_tokens=TOKENS,
        dtype="bfloat16",
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
    )
    with compiling_for_target("h100", 4) as devices:
        runner = abstract_worker(args, devices).runner
        graphdef, params, pool = runner.step_programs.graphdef, runner.params, runner.cache.kv
        whole = NamedSharding(runner.parallel.mesh, PartitionSpec())
        staged = NamedSharding(runner.parallel.mesh, PartitionSpec(PIPELINE_AXIS))
        rows = TOKENS if decode else 4

        def ints(*shape):
            return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=whole)

        meta = AttentionMetadata(
            ints(TOKENS), ints(TOKENS), ints(rows + 1), ints(rows), ints(rows, PAGES), ints(), decode
        )
        hidden_size = jax.eval_shape(lambda p: nnx.merge(graphdef, p).embed[...], params).shape[1]
        carry = jax.eval_shape(lambda m: empty_carry(2, hidden_size, jnp.bfloat16, m), meta)
        carry = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), carry)
        carry = dataclasses.replace(
            carry, hidden=jax.ShapeDtypeStruct(carry.hidden.shape, jnp.bfloat16, sharding=staged)
        )

        def step(params, carry, token_ids, pool, meta, entering):
            model = nnx.merge(graphdef, params)
            hidden, exited, carry, pool = model.pipeline_tick(carry, token_ids, pool, meta, entering)
            return model.compute_logits(hidden), exited, carry, pool

        shardings = (whole, whole, jax.tree.map(lambda a: a.sharding, carry), jax.tree.map(lambda a: a.sharding, pool))
        jitted = jax.jit(step, donate_argnums=(1, 3), out_shardings=shardings)
        entering = jax.ShapeDtypeStruct((), bool, sharding=whole)
        return jitted.lower(params, carry, ints(TOKENS), pool, meta, entering).compile()


@pytest.mark.parametrize("decode", [True, False], ids=["decode", "ragged"])
def test_h100_tick_updates_the_pool_in_place_and_waits_on_nothing(tmp_path, decode):
    model = tiny_dir(tmp_path)
    small, large = compile_tick(model, SMALL_POOL, decode), compile_tick(model, LARGE_POOL, decode)
    assert_no_host_waits({"tick": large})
    text = large.as_text()
    assert "all-to-all" not in text
    for moved in re.findall(r"= (\S+|\(.*?\)) collective-permute(?:-start)?\(", text):  # stage to stage
        assert "bf16[" in moved and "s32[" not in moved and "pred[" not in moved, moved  # activations only
    small, large = small.memory_analysis(), large.memory_analysis()
    assert abs(large.temp_size_in_bytes - small.temp_size_in_bytes) <= TOLERANCE, (small, large)
    assert large.alias_size_in_bytes >= LARGE_POOL * 0.95, large
