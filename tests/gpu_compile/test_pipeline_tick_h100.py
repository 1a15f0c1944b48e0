"""The pipelined engine's tick programs (`StepPrograms` under pipeline parallelism: one
`Llama.pipeline_tick` a step) as they will run on H100s (deviceless compilation, see
test_h100_programs.py): 2 stages of 2 GPUs, the carry and the pool donated, the carry's
activations split over the stages and its metadata whole on every GPU. The pool is updated in
place (the temporaries do not grow with it), nothing waits on the host, and the only
collectives over the stages move activations (no all-to-all of metadata), for decode and ragged
micro-batches alike.
"""

import re

import pytest
from test_h100_programs import LARGE_POOL, SMALL_POOL, TOLERANCE, assert_no_host_waits, h100_engine_args, tiny_dir

from jaxpaged.bench.gpu_targets import compiling_for_target
from jaxpaged.bench.startup import abstract_worker
from jaxpaged.worker.step_programs import Program

TOKENS = 16  # a micro-batch's tokens


def compile_tick(model: str, pool_bytes: int, decode: bool):
    """The engine's tick program of `TOKENS`-token micro-batches compiled for 4 H100s, 2 stages
    of 2."""
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
        return runner.step_programs.lower(Program(TOKENS, 1, decode), runner.params, runner.cache).compile()


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
