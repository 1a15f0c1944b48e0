"""KV-cache planning arithmetic (jaxpaged.planning.memory)."""

import os

import pytest
from test_config import LLAMA_31_8B

from jaxpaged.config.hf_config import model_config_from_hf
from jaxpaged.config.model_config import kv_bytes_per_token
from jaxpaged.planning.memory import GiB, plan_kv_cache, sequence_state_bytes

LLAMA_8B = model_config_from_hf(LLAMA_31_8B)
LLAMA_70B = model_config_from_hf(
    {**LLAMA_31_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64}
)


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
    state = sequence_state_bytes(256, LLAMA_8B.vocab_size)
    assert state == 256 * (128256 * 5 + 4) and 156 * 2**20 < state < 157 * 2**20  # penalty tables, last tokens
    plan = plan_kv_cache(
        LLAMA_8B,
        dtype_bytes=2,
        block_size=16,
        max_model_len=8192,
        device_memory_bytes=80 * GiB,
        gpu_memory_utilization=0.9,
        weight_bytes=weights,
        activation_bytes=activations,
        state_bytes=state,
    )
    budget = int(80 * GiB * 0.9) - weights - activations - state
    assert plan.num_blocks == budget // (131_072 * 16)
    assert plan.pool_bytes <= budget


def test_too_small_fails_with_the_numbers_and_knobs():
    with pytest.raises(ValueError, match="max_model_len=131072 needs 8192") as err:
        plan_kv_cache(LLAMA_8B, dtype_bytes=2, block_size=16, max_model_len=131072, kv_cache_memory_bytes=GiB)
    assert "gpu_memory_utilization" in str(err.value) and "kv_cache_memory_bytes" in str(err.value)


def test_cpu_pool_is_sized_from_the_job_and_capped_by_host_memory(monkeypatch):
    from jaxpaged.engine import setup as engine_setup

    per_block = kv_bytes_per_token(LLAMA_8B, 4) * 16
    budget = engine_setup._cpu_budget(16, 3, LLAMA_8B, 4, 100)
    assert budget["kv_cache_memory_bytes"] == (3 * 7 + 1) * per_block  # 7 blocks per request + the null block
    assert "the job: max_num_seqs=3 x max_model_len=100" in budget["sized_from"]
    plan = plan_kv_cache(LLAMA_8B, dtype_bytes=4, block_size=16, max_model_len=100, **budget)
    assert plan.num_blocks == 22 and plan.max_concurrency == 3
    monkeypatch.setattr(engine_setup, "host_memory_bytes", lambda: 40 * per_block)
    capped = engine_setup._cpu_budget(16, 3, LLAMA_8B, 4, 100)
    assert capped["kv_cache_memory_bytes"] == 10 * per_block and "25% of this machine's memory" in capped["sized_from"]


def test_start_up_fails_when_a_step_needs_more_temporaries_than_planned():
    from jaxpaged.engine.setup import TEMP_SLACK_BYTES, check_step_memory
    from jaxpaged.worker.step_programs import Program

    plan = plan_kv_cache(
        LLAMA_8B,
        dtype_bytes=2,
        block_size=16,
        max_model_len=4096,
        device_memory_bytes=80 * GiB,
        weight_bytes=16 * GiB,
        activation_bytes=GiB,
    )
    mixed, decode = Program(2048, 1, False), Program(256, 4, True)
    check_step_memory(plan, {mixed: GiB, decode: GiB // 2})
    check_step_memory(plan, {mixed: GiB + TEMP_SLACK_BYTES})
    with pytest.raises(
        RuntimeError,
        match=r"\(decode step, 256 tokens x 4 step\(s\), sampler plain\) needs 2.000 GiB .* reserved 1.000 GiB",
    ):
        check_step_memory(plan, {mixed: GiB, decode: 2 * GiB})
    unmeasured = plan_kv_cache(LLAMA_8B, dtype_bytes=2, block_size=16, max_model_len=4096, kv_cache_memory_bytes=GiB)
    check_step_memory(unmeasured, {mixed: 2 * GiB})  # an exact budget: nothing was reserved to check


def test_the_plan_counts_every_per_sequence_array_of_the_cache():
    """Everything the cache holds beside the pool is per sequence, and `sequence_state_bytes`
    counts all of it (a new per-sequence array left out of the plan fails here), but the LoRA
    adapter pool, which `pool_bytes` counts (the start-up plan subtracts both)."""
    import jax
    import jax.numpy as jnp

    from jaxpaged.config.lora import pool_bytes
    from jaxpaged.functional import init_cache

    for max_num_seqs in (4, 256):
        cache = jax.eval_shape(
            lambda: init_cache(LLAMA_8B, num_blocks=3, block_size=16, dtype=jnp.bfloat16, max_num_seqs=max_num_seqs)
        )
        beside_pool = [x for name, x in vars(cache).items() if name not in ("kv", "lora")]
        assert sum(x.size * x.dtype.itemsize for x in beside_pool) == sequence_state_bytes(max_num_seqs, 128256)
    lora = jax.eval_shape(  # and the LoRA adapter pool, counted by `pool_bytes`
        lambda: init_cache(
            LLAMA_8B, num_blocks=3, block_size=16, dtype=jnp.bfloat16, max_num_seqs=4, lora=(8, 16, jnp.bfloat16)
        )
    ).lora
    counted = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(lora))
    assert counted == pool_bytes(LLAMA_8B, 8, 16, 2) and counted > 0


def test_the_activation_probe_reserves_the_fused_decode_programs_temporaries(tmp_path, monkeypatch):
    """The plan reserves the larger of the largest mixed step and the largest fused decode
    program (an H100's int4 engine refused to start when only the mixed step was measured): a
    fused program reported 1 GiB of temporaries is what the probe returns."""
    from tiny_models import save_hf_model

    from jaxpaged.engine import setup as engine_setup
    from jaxpaged.engine_args import EngineArgs
    from jaxpaged.engine_config import EngineConfig
    from jaxpaged.parallel.mesh import TensorParallel, make_mesh
    from jaxpaged.worker.model_runner import ModelRunner

    save_hf_model("llama_tp", str(tmp_path))
    args = EngineArgs(
        model=str(tmp_path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        num_scheduler_steps=4,
    )
    config = EngineConfig.resolve(args)
    parallel = TensorParallel(config.layout, make_mesh(1))
    model = engine_setup.build_model(config, parallel)
    real = engine_setup._peak_activation_bytes(config, model, parallel)
    assert 0 < real < GiB
    keep = ModelRunner._keep

    def fused_reports_a_gib(self, program, compiled):
        out = keep(self, program, compiled)
        if getattr(program, "steps", 1) > 1:
            self.temp_bytes[program] = GiB
        return out

    monkeypatch.setattr(ModelRunner, "_keep", fused_reports_a_gib)
    assert engine_setup._peak_activation_bytes(config, model, parallel) == GiB


def test_importing_jaxpaged_keeps_the_gpu_allocator_preallocated():
    """An allocator grown on demand fragmented on an H100 (an 8B pool's second 27 GiB half could
    not be placed with 4 GiB to spare): jaxpaged's defaults keep one preallocated region of 95%,
    and a user's own settings win."""
    import subprocess
    import sys

    code = "import os, jaxpaged; print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'], os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])"
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_PYTHON_CLIENT_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["true", "0.95"]
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["false", "0.95"]


def test_a_gpu_plan_leaves_room_for_the_lora_adapter_pool(tmp_path, monkeypatch):
    """With LoRA on, a plan from the device's memory subtracts the adapter pool's bytes (the pool
    shrinks by that much, to the block)."""
    from tiny_models import save_hf_model

    from jaxpaged.config.lora import pool_bytes
    from jaxpaged.engine import setup as engine_setup
    from jaxpaged.engine_args import EngineArgs
    from jaxpaged.engine_config import EngineConfig
    from jaxpaged.parallel.mesh import TensorParallel, make_mesh

    save_hf_model("llama_tp", str(tmp_path))
    monkeypatch.setattr(engine_setup, "_peak_activation_bytes", lambda *a: 0)  # no compile here
    pools = {}
    for lora in (False, True):
        args = EngineArgs(
            model=str(tmp_path),
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=64,
            enable_lora=lora,
            max_loras=8,
            max_lora_rank=16,
        )
        config = EngineConfig.resolve(args).with_batch_limits("cpu", "cpu", None)
        parallel = TensorParallel(config.layout, make_mesh(1))
        model = engine_setup.build_model(config, parallel)
        pools[lora] = engine_setup.plan_cache(config, model, parallel, memory_bytes=GiB // 16)
    adapters = pool_bytes(config.layout.mesh_config, 8, 16, 4)
    block = pools[True].pool_bytes // pools[True].num_blocks
    assert 0 <= pools[False].pool_bytes - pools[True].pool_bytes - adapters < block
