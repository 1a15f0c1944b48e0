"""KV-cache planning arithmetic (jaxpaged.memory)."""

import pytest
from test_config import LLAMA_31_8B

from jaxpaged.config import ModelConfig, kv_bytes_per_token
from jaxpaged.memory import GiB, plan_kv_cache

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
