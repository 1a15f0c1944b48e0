"""`jaxpaged plan`: exact parameter counts, KV bytes per token and per request, TP splits, presets."""

import json
import subprocess
import sys

import pytest
from tiny_models import build_hf_model

from jaxpaged.cli import main
from jaxpaged.config.hf_config import model_config_from_hf, read_model_config
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.presets import PRESETS, get_preset
from jaxpaged.entrypoints.cli_flags import parse_bytes
from jaxpaged.parallel.sharding import TensorParallelError, TensorParallelLayout
from jaxpaged.planning.memory import plan_kv_cache
from jaxpaged.planning.plan import count_parameters, make_plan

MiB, GiB = 2**20, 2**30


def plan_json(capsys, *argv, fits: bool = True) -> dict:
    assert main(["plan", *argv, "--json"]) == (0 if fits else 1)  # exit 1: the model does not fit
    return json.loads(capsys.readouterr().out)


def test_llama_31_8b_table_and_json(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu-memory", "80GiB", "--context", "4096"]) == 0
    table = capsys.readouterr().out
    assert "131,072 B (128.00 KiB)" in table and "536,870,912 B (512.00 MiB)" in table
    assert "8,030,261,248" in table and "max concurrency at 4,096" in table
    r = plan_json(capsys, "--model", "LLAMA-3.1-8B", "--context", "4096")
    assert r["kv_bytes_per_token"] == 131_072 and r["kv_bytes_per_request"] == 512 * MiB
    assert r["num_parameters"] == 8_030_261_248 and r["weight_bytes_per_gpu"] == 2 * 8_030_261_248
    assert r["fits"] and r["pool_tokens"] == r["kv_cache_blocks"] * 16
    budget = int(80 * GiB * 0.9) - r["weight_bytes_per_gpu"]
    assert r["kv_cache_blocks"] == budget // (131_072 * 16) - 1  # the engine's null block included
    assert r["max_concurrency"] == pytest.approx(r["kv_cache_blocks"] / 256, abs=0.01)


def test_llama_31_70b_needs_tensor_parallelism(capsys):
    r = plan_json(capsys, "--model", "llama-3.1-70b", "--context", "8192", fits=False)
    assert r["kv_bytes_per_token"] == 327_680 and r["num_parameters"] == 70_553_706_496
    assert not r["fits"] and "--tensor-parallel-size 2 fits" in r["note"]
    tp4 = plan_json(capsys, "--model", "llama-3.1-70b", "--context", "8192", "--tensor-parallel-size", "4")
    assert tp4["fits"] and tp4["kv_bytes_per_token"] == 327_680 // 4 and tp4["kv_bytes_per_token_all_gpus"] == 327_680
    assert main(["plan", "--model", "llama-3.1-70b"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT: weights take 131.42 GiB of the 72.00 GiB that --gpu-memory-utilization 0.9" in out


def test_tensor_parallel_halves_per_gpu_kv_and_weights(capsys):
    one = plan_json(capsys, "--model", "llama-3.1-8b", "--context", "4096")
    two = plan_json(capsys, "--model", "llama-3.1-8b", "--context", "4096", "--tensor-parallel-size", "2")
    assert two["kv_bytes_per_token"] == one["kv_bytes_per_token"] // 2 == 65_536
    assert two["kv_bytes_per_request"] == 256 * MiB
    norms = 2 * (2 * 32 + 1) * 4096  # RMSNorm scales are replicated, everything else splits
    assert two["weight_bytes_per_gpu"] == (one["weight_bytes_per_gpu"] - norms) // 2 + norms
    assert two["max_concurrency"] > 2 * one["max_concurrency"]
    # More GPUs than KV heads: one KV head each (replicated), so per-GPU KV stops shrinking.
    sixteen = plan_json(capsys, "--model", "llama-3.1-8b", "--context", "4096", "--tensor-parallel-size", "16")
    assert sixteen["kv_heads_per_gpu"] == 1 and sixteen["kv_bytes_per_token"] == 131_072 // 8


def test_presets_are_the_public_configs():
    assert set(PRESETS) == {
        "llama-3.1-8b",
        "llama-3.1-70b",
        "llama-3.1-405b",
        "mistral-7b-v0.3",
        "qwen2.5-7b",
        "mixtral-8x7b",
        "qwen3-30b-a3b",
        "phi-4",
        "phi-4-mini",
        "gemma-3-1b",
    }
    assert get_preset("meta-llama/Llama-3.1-8B") == PRESETS["llama-3.1-8b"] and get_preset("gpt-2") is None
    assert count_parameters(model_config_from_hf(get_preset("Mistral-7B-v0.3")))[0] == 7_248_023_552
    qwen = model_config_from_hf(get_preset("Qwen2.5-7B"))
    assert qwen.qkv_bias and qwen.sliding_window is None and count_parameters(qwen)[0] == 7_615_616_512
    # microsoft/phi-4's 14.66B and Phi-4-mini's 3.84B (tied embeddings), their fused tensors counted once
    assert count_parameters(model_config_from_hf(get_preset("phi-4")))[0] == 14_659_507_200
    assert count_parameters(model_config_from_hf(get_preset("phi-4-mini")))[0] == 3_836_021_760
    # google/gemma-3-1b's 999,885,952 (tied embeddings; four norms a layer and q/k norms)
    gemma = model_config_from_hf(get_preset("gemma-3-1b"))
    assert count_parameters(gemma)[0] == 999_885_952 and [gemma.window_of(i) for i in (4, 5)] == [512, None]
    r = make_plan("qwen2.5-7b", gpu_memory=24 * GiB, context=32768)
    assert r["kv_bytes_per_token"] == 2 * 28 * 4 * 128 * 2 and r["kv_bytes_per_request"] == 1792 * MiB


def test_mixtral_8x7b_on_two_80gb_gpus_in_bfloat16_or_one_in_fp8(capsys):
    """46.7B parameters of which 12.9B compute each token (2 of 8 experts; Qwen3-30B-A3B: 30.5B and
    3.3B, 8 of 128): bfloat16 weights take 87 GiB, over one 80 GB GPU; two hold them, and so does
    one with fp8 weights."""
    one = plan_json(capsys, "--model", "mixtral-8x7b", "--gpu-memory", "80GB", "--context", "32768", fits=False)
    assert one["num_parameters"] == 46_702_792_704 and one["num_active_parameters"] == 12_879_925_248
    assert "--tensor-parallel-size 2 fits" in one["note"]
    two = plan_json(capsys, "--model", "mixtral-8x7b", "--gpu-memory", "80GB", "--tensor-parallel-size", "2")
    fp8 = plan_json(capsys, "--model", "mixtral-8x7b", "--gpu-memory", "80GB", "--quantization", "fp8")
    assert two["fits"] and fp8["fits"] and fp8["weight_bytes_per_gpu"] < 44 * GiB
    qwen = plan_json(capsys, "--model", "qwen3-30b-a3b", "--gpu-memory", "80GB")
    assert qwen["num_parameters"] == 30_532_122_624 and qwen["num_active_parameters"] == 3_353_032_704
    assert main(["plan", "--model", "mixtral-8x7b", "--tensor-parallel-size", "2"]) == 0
    assert "46,702,792,704 (12,879,925,248 active per token)" in capsys.readouterr().out


@pytest.mark.parametrize("variant", ["llama_gqa4", "qwen2_bias", "llama_tied", "qwen2_moe"])
def test_parameter_count_is_exact_and_directories_work(tmp_path, capsys, variant):
    hf = build_hf_model(variant)
    hf.config.architectures = [type(hf).__name__]
    hf.config.to_json_file(tmp_path / "config.json")
    config = read_model_config(tmp_path)
    assert count_parameters(config)[0] == sum(p.numel() for p in hf.parameters())
    r = plan_json(capsys, "--model", str(tmp_path), "--gpu-memory", "1GiB", "--context", "64", "--dtype", "float32")
    expected = plan_kv_cache(
        config,
        dtype_bytes=4,
        block_size=16,
        max_model_len=64,
        device_memory_bytes=GiB,
        weight_bytes=r["weight_bytes_per_gpu"],
    )
    assert r["kv_cache_blocks"] == expected.num_blocks - 1 and r["kv_bytes_per_token"] == expected.bytes_per_token


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_and_gptq_on_a_preset_count_their_4_bit_layout(capsys, method):
    """ "How much does 70B-AWQ need" has an answer on the preset (issue 45): the 4-bit codes with
    a scale and a zero point per group, as the engine holds such a checkpoint (int4's bytes at
    the same group size), on one 80 GB GPU; bfloat16 needs two."""
    common = ("--model", "llama-3.1-70b", "--gpu-memory", "80GiB", "--context", "8192")
    named = plan_json(capsys, *common, "--quantization", method)
    int4 = plan_json(capsys, *common, "--quantization", "int4")
    assert named["quantization"] == method and (named["weight_bits"], named["weight_group_size"]) == (4, 128)
    assert named["weight_bytes_per_gpu"] == int4["weight_bytes_per_gpu"]
    assert 35 * GiB < named["weight_bytes_per_gpu"] < 40 * GiB and named["max_concurrency"] > 1
    groups_of_64 = plan_json(capsys, *common, "--quantization", method, "--quantization-group-size", "64")
    assert groups_of_64["weight_bytes_per_gpu"] > named["weight_bytes_per_gpu"]
    plan_json(capsys, "--model", "llama-3.1-70b", "--gpu-memory", "80GiB", "--context", "8192", fits=False)


def test_bad_arguments_name_the_flag(capsys):
    assert main(["plan", "--model", "no-such-model"]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3.1-8b", "--context", "200000"]) == 2
    assert "--context" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen2.5-7b", "--tensor-parallel-size", "3"]) == 2
    assert "num_attention_heads=28" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu-memory", "lots"]) == 2
    assert "memory size" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3.1-8b", "--block-size", "12"]) == 2
    assert "--block-size 12: must be a power of two" in capsys.readouterr().err  # the engine's own check


def test_parse_bytes_and_kv_head_split():
    assert parse_bytes("80GiB") == parse_bytes("80G") == 80 * GiB and parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("1.5 TiB") == 3 * 2**39 and parse_bytes("4096") == 4096
    seventy_b = model_config_from_hf(get_preset("llama-3.1-70b"))  # 8 kv heads
    split = [TensorParallelLayout(seventy_b, tp) for tp in (1, 2, 4, 8, 16)]
    assert [s.device_config.num_kv_heads for s in split] == [8, 4, 2, 1, 1]
    assert [s.kv_replicas for s in split] == [1, 1, 1, 1, 2]
    odd = ModelConfig(
        "llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=36,
        num_layers=1,
        num_heads=24,
        num_kv_heads=4,
        head_dim=8,
    )
    with pytest.raises(TensorParallelError, match="num_key_value_heads=4: one must divide the other"):
        TensorParallelLayout(odd, 3)
    with pytest.raises(TensorParallelError, match="tensor_parallel_size=8 must divide intermediate_size=36"):
        TensorParallelLayout(odd, 8)


def test_plan_needs_no_jax():
    code = (
        "import sys; from jaxpaged.cli import main; main(['plan', '--model', 'llama-3.1-8b', '--json']); "
        "assert not [m for m in sys.modules if m.split('.')[0] in ('jax', 'torch')], 'JAX was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kv_bytes_per_token"] == 131_072


def test_a_lora_adapter_pool_is_counted_beside_the_weights(capsys):
    """`--enable-lora --max-loras 8 --max-lora-rank 16` on Llama-3.1-8B: the pool's 640 MiB (32
    layers x 8 slots x rank 16 x the seven projections' in + out, bfloat16) come out of the KV
    pool, as the engine's start-up counts them; a layout the engine refuses LoRA on is refused."""
    argv = ["--model", "llama-3.1-8b", "--gpu-memory", "80GiB", "--context", "8192"]
    base = plan_json(capsys, *argv)
    lora = plan_json(capsys, *argv, "--enable-lora", "--max-loras", "8", "--max-lora-rank", "16")
    d, kv, f = 4096, 1024, 14336
    per_layer = (d + d) + 2 * (d + kv) + (d + d) + 2 * (d + f) + (f + d)  # q, k, v, o, gate, up, down
    assert base["lora_pool_bytes_per_gpu"] == 0 and lora["lora_pool_bytes_per_gpu"] == 32 * 8 * 16 * per_layer * 2
    budget = int(80 * GiB * 0.9) - lora["weight_bytes_per_gpu"] - lora["lora_pool_bytes_per_gpu"]
    assert lora["kv_cache_blocks"] == budget // (131_072 * 16) - 1 < base["kv_cache_blocks"]
    assert main(["plan", *argv, "--enable-lora"]) == 0 and "LoRA adapter pool per GPU" in capsys.readouterr().out
    with pytest.raises(ValueError, match="under pipeline parallelism"):
        make_plan("llama-3.1-8b", gpu_memory=80 * GiB, pipeline_parallel_size=2, enable_lora=True)
