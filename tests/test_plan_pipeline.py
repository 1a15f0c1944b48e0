"""`jaxpaged plan` under pipeline parallelism: Llama-3.1-405B at TP 8 x PP 2 (bf16, fp8) and 70B at
TP 4 x PP 2, each number against a count written out from the model's config.json here (not the
sharding table's code path); `--enable-expert-parallel`."""

import json

import pytest

from jaxpaged.cli import main
from jaxpaged.config.presets import get_preset
from jaxpaged.planning.plan import make_plan

GiB = 2**30
BUDGET = int(80 * GiB * 0.9)  # the default --gpu-memory x --gpu-memory-utilization


def plan(capsys, *argv, fits: bool = True) -> dict:
    assert main(["plan", *argv, "--json"]) == (0 if fits else 1)
    return json.loads(capsys.readouterr().out)


def expected_weights(preset: str, tp: int, stage_layers: int, fp8: bool = False) -> tuple[int, int]:
    """`(bytes per GPU, of which the embedding, final norm and LM head)` of a Llama checkpoint
    on `tp` GPUs holding `stage_layers` layers: Megatron splits (q/k/v, gate/up by output, o/down by
    input; kv heads repeated up to `tp`), norms whole, bf16; fp8 weights take 1 byte per matrix
    element plus a float32 scale per output channel (o/down's outputs are the whole hidden size)."""
    c = get_preset(preset)
    h, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = h // c["num_attention_heads"]
    kv = max(c["num_key_value_heads"], tp) * head_dim  # k (or v) projection outputs, repeated
    matrices = (2 * h * h + 2 * h * kv + 3 * h * f) // tp
    scales = (h + 2 * kv + 2 * f) // tp + 2 * h  # q, k, v, gate, up split; o, down whole
    layer = 2 * (2 * h) + (matrices + 4 * scales if fp8 else 2 * matrices)
    outer = 2 * (2 * v * h // tp + h)
    return outer + stage_layers * layer, outer


def expected_kv_per_token(preset: str, tp: int, stage_layers: int, dtype_bytes: int = 2) -> int:
    c = get_preset(preset)
    kv_heads = max(c["num_key_value_heads"], tp) // tp
    return 2 * stage_layers * kv_heads * (c["hidden_size"] // c["num_attention_heads"]) * dtype_bytes


@pytest.mark.parametrize("fp8", [False, True])
def test_llama_405b_on_two_stages_of_eight_gpus(capsys, fp8):
    """126 layers in two stages of 63: per GPU half the layers of TP 8 alone, plus the embedding
    and LM head, which every stage holds. On 80 GiB GPUs TP 8 alone does not fit in bf16."""
    quant = ["--quantization", "fp8"] if fp8 else []
    r = plan(capsys, "--model", "llama-3.1-405b", "-tp", "8", "-pp", "2", *quant)
    weights, outer = expected_weights("llama-3.1-405b", 8, 63, fp8)
    assert r["num_parameters"] == 405_853_388_800 and r["weight_bytes_per_gpu"] == weights
    assert r["pipeline_parallel_size"] == 2 and r["layers_per_stage"] == [63, 63] and r["num_gpus"] == 16
    per_token = expected_kv_per_token("llama-3.1-405b", 8, 63)
    assert r["kv_bytes_per_token"] == per_token == 32_256 and r["kv_bytes_per_token_all_gpus"] == 2 * 126 * 8 * 128 * 2
    assert r["fits"] and r["kv_cache_blocks"] == (BUDGET - weights) // (per_token * 16) - 1
    one_stage = plan(capsys, "--model", "llama-3.1-405b", "-tp", "8", *quant, fits=fp8)
    assert one_stage["weight_bytes_per_gpu"] == expected_weights("llama-3.1-405b", 8, 126, fp8)[0]
    assert r["weight_bytes_per_gpu"] == (one_stage["weight_bytes_per_gpu"] - outer) // 2 + outer
    if not fp8:
        assert one_stage["note"].endswith("; --tensor-parallel-size 8 --pipeline-parallel-size 2 fits")


def test_llama_70b_on_two_stages_of_four_gpus_even_and_uneven(capsys):
    r = plan(capsys, "--model", "llama-3.1-70b", "--tensor-parallel-size", "4", "--pipeline-parallel-size", "2")
    assert r["weight_bytes_per_gpu"] == expected_weights("llama-3.1-70b", 4, 40)[0] == 18_164_760_576
    assert r["kv_bytes_per_token"] == expected_kv_per_token("llama-3.1-70b", 4, 40) == 40_960 and r["fits"]
    # The longest stage decides: every stage holds its slots (a shorter one's hold zeros).
    uneven = plan(capsys, "--model", "llama-3.1-70b", "-tp", "4", "-pp", "2", "--pp-layer-partition", "50,30")
    assert uneven["layers_per_stage"] == [50, 30]
    assert uneven["weight_bytes_per_gpu"] == expected_weights("llama-3.1-70b", 4, 50)[0]
    assert uneven["kv_bytes_per_token"] == expected_kv_per_token("llama-3.1-70b", 4, 50)
    assert main(["plan", "--model", "llama-3.1-70b", "-tp", "4", "-pp", "2", "--pp-layer-partition", "50,30"]) == 0
    table = capsys.readouterr().out
    assert "pipeline parallel                        2 stages of 50 + 30 layers; 4 x 2 = 8 GPUs in all" in table
    assert "KV bytes per token per GPU               51,200 B (50.00 KiB)  (all GPUs: 327,680 B)" in table


def test_a_model_that_does_not_fit_is_offered_wider_tp_before_stages():
    """More GPUs go to tensor parallelism up to a machine's 8, then to pipeline stages."""
    tp2 = make_plan("llama-3.1-405b", gpu_memory=80 * GiB, tensor_parallel_size=2, quantization="fp8")
    assert tp2["note"].endswith("; --tensor-parallel-size 8 fits")
    pp2 = make_plan("llama-3.1-405b", gpu_memory=80 * GiB, tensor_parallel_size=4, pipeline_parallel_size=2)
    assert pp2["note"].endswith("; --tensor-parallel-size 8 --pipeline-parallel-size 2 fits")


def test_bad_pipelines_and_expert_parallelism_name_the_flag(capsys):
    assert main(["plan", "--model", "llama-3.1-8b", "-pp", "2", "--pp-layer-partition", "20,13"]) == 2
    assert (
        "--pp-layer-partition 20,13: must give each of the 2 stages (--pipeline-parallel-size)"
        in capsys.readouterr().err
    )
    assert main(["plan", "--model", "llama-3.1-8b", "-pp", "33"]) == 2
    assert "--pipeline-parallel-size 33: exceeds the model's 32 decoder layers" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-3.1-8b", "--enable-expert-parallel"]) == 2
    assert "has no experts; drop --enable-expert-parallel" in capsys.readouterr().err
    assert main(["plan", "--model", "mixtral-8x7b", "-tp", "16", "--enable-expert-parallel"]) == 2
    assert (
        "--tensor-parallel-size 16: exceeds the number of experts (8) under expert parallelism"
        in capsys.readouterr().err
    )
    assert main(["plan", "--model", "mixtral-8x7b", "-tp", "2", "-pp", "2", "--enable-expert-parallel"]) == 0
    table = capsys.readouterr().out
    assert "2 GPU(s) per stage, 4 KV head(s) per GPU, whole experts per GPU (expert parallel)" in table
