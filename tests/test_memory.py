"""KV-cache planning arithmetic (jaxpaged.planning.memory)."""

import pytest
from test_config import LLAMA_31_8B

from jaxpaged.config.model_config import ModelConfig, kv_bytes_per_token
from jaxpaged.planning.memory import GiB, plan_kv_cache

LLAMA_8B = ModelConfig.from_hf(LLAMA_31_8B)
LLAMA_70B = ModelConfig.from_hf({**LLAMA_31_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64})


def test_bytes_per_token():
    assert kv_bytes_per_token(LLAMA_8B, 2) == 131_072
    assert kv_bytes_per_token(LLAMA_8B, 2) * 4096 == 512 * 2**20
    assert kv_bytes_per_token(LLAMA_70B, 2) == 327_680


def test_exact_budget():
    plan = plan_kv_cache(LLAMA_8B, dtype_bytes=2, block_size=16, max_model_len=4096, kv_cache_memory_bytes=4 * GiB)
    assert plan.num_blocks == 4 * GiB // (131_072 * 16)  # 2048 blocks, the null block included
    assert plan.num_tokens == (plan.num_blocks - 1) * 16
    assert plan.max_concurrency == pytest.approx((plan.num_blocks - 1) / 256)
    assert "max concurrency at max_model_len=4096" in plan.summary()


def test_device_memory_budget():
    weights, activations = 16 * GiB, 2 * GiB
    plan = plan_kv_cache(LLAMA_8B, dtype_bytes=2, block_size=16, max_model_len=8192, device_memory_bytes=80 * GiB,
                         gpu_memory_utilization=0.9, weight_bytes=weights, activation_bytes=activations)  # fmt: skip
    budget = int(80 * GiB * 0.9) - weights - activations
    assert plan.num_blocks == budget // (131_072 * 16)
    assert plan.pool_bytes <= budget


def test_too_small_fails_with_the_numbers_and_knobs():
    with pytest.raises(ValueError, match="max_model_len=131072 needs 8192") as err:
        plan_kv_cache(LLAMA_8B, dtype_bytes=2, block_size=16, max_model_len=131072, kv_cache_memory_bytes=GiB)
    assert "gpu_memory_utilization" in str(err.value) and "kv_cache_memory_bytes" in str(err.value)


def test_cpu_pool_is_sized_from_the_job_and_capped_by_host_memory(monkeypatch):
    from jaxpaged.config.engine_args import EngineArgs
    from jaxpaged.engine import setup as engine_setup
    from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR

    args = EngineArgs(model=DEMO_MODEL_DIR, max_num_seqs=3, max_model_len=100, block_size=16)
    per_block = kv_bytes_per_token(LLAMA_8B, 4) * 16
    budget = engine_setup._cpu_budget(args, LLAMA_8B, 4, 100)
    assert budget["kv_cache_memory_bytes"] == (3 * 7 + 1) * per_block  # 7 blocks per request + the null block
    assert "the job: max_num_seqs=3 x max_model_len=100" in budget["sized_from"]
    plan = plan_kv_cache(LLAMA_8B, dtype_bytes=4, block_size=16, max_model_len=100, **budget)
    assert plan.num_blocks == 22 and plan.max_concurrency == 3
    monkeypatch.setattr(engine_setup, "host_memory_bytes", lambda: 40 * per_block)
    capped = engine_setup._cpu_budget(args, LLAMA_8B, 4, 100)
    assert capped["kv_cache_memory_bytes"] == 10 * per_block and "25% of this machine's memory" in capped["sized_from"]


def test_start_up_fails_when_a_step_needs_more_temporaries_than_planned():
    from jaxpaged.engine.setup import TEMP_SLACK_BYTES, check_step_memory
    from jaxpaged.worker.step_programs import Program

    plan = plan_kv_cache(LLAMA_8B, dtype_bytes=2, block_size=16, max_model_len=4096, device_memory_bytes=80 * GiB,
                         weight_bytes=16 * GiB, activation_bytes=GiB)  # fmt: skip
    mixed, decode = Program(2048, 1, False), Program(256, 4, True)
    check_step_memory(plan, {mixed: GiB, decode: GiB // 2})
    check_step_memory(plan, {mixed: GiB + TEMP_SLACK_BYTES})
    with pytest.raises(RuntimeError, match=r"\(decode step, 256 tokens x 4 step\(s\), sampler plain\) needs 2.000 GiB .* reserved 1.000 GiB"):
        check_step_memory(plan, {mixed: GiB, decode: 2 * GiB})
    unmeasured = plan_kv_cache(LLAMA_8B, dtype_bytes=2, block_size=16, max_model_len=4096, kv_cache_memory_bytes=GiB)
    check_step_memory(unmeasured, {mixed: 2 * GiB})  # an exact budget: nothing was reserved to check
