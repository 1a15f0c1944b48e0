"""The AWQ, GPTQ and compressed-tensors pack-quantized readers against independent packers
(tests/int4_checkpoints.py): every variant dequantizes to the packer's own reference exactly, and
files that are not exactly the layout are refused from their headers, naming the tensor."""

import os

import numpy as np
import pytest
import torch
from fp8_checkpoint import quantization_config as fp8_quantization_config
from int4_checkpoints import (
    checkpoint_kinds,
    compressed_config,
    gptq_config,
    pack,
    pack_awq,
    pack_compressed,
    pack_gptq,
    save_int4_checkpoint,
)
from safetensors.torch import save_file

from jaxpaged.checkpoint.formats import check_linears, linear_reader, quantized_linears
from jaxpaged.checkpoint.safetensors_index import SafetensorsCheckpoint
from jaxpaged.config.group_formats import (
    CheckpointQuantizationError,
    GroupFormat,
    awq_format,
    gptq_format,
    pack_quantized_format,
)
from jaxpaged.config.hf_config import model_config_from_hf
from jaxpaged.config.presets import load_config_dict
from jaxpaged.config.quantization import checkpoint_group_format, checkpoint_quantization, resolve_quantization
from jaxpaged.parallel.sharding import TensorParallelLayout

PREFIX = "model.layers.0.mlp.down_proj"
NUM_OUT, NUM_IN = 48, 64
PARSE = {"awq": awq_format, "gptq": gptq_format, "compressed-tensors": pack_quantized_format}


def fmt_of(qconfig: dict):
    return PARSE[qconfig["quant_method"]](qconfig)


def weight(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 0.1, (NUM_OUT, NUM_IN)).astype(np.float32)


def write(tmp_path, stored: dict) -> SafetensorsCheckpoint:
    save_file({f"{PREFIX}.{k}": v.contiguous() for k, v in stored.items()}, os.path.join(tmp_path, "model.safetensors"))
    return SafetensorsCheckpoint(tmp_path)


def headers(ckpt: SafetensorsCheckpoint) -> dict:
    return {n: (ckpt.shape(n), ckpt.dtype(n)) for n in ckpt.names}


def read_one(fmt, ckpt: SafetensorsCheckpoint):
    _, read_linear = linear_reader(fmt, [(PREFIX, NUM_IN, NUM_OUT)], ckpt, fmt.group_size or NUM_IN)
    return read_linear(PREFIX)


@pytest.mark.parametrize("kind", sorted(checkpoint_kinds()))
def test_reader_reproduces_packer(tmp_path, kind):
    packer, qconfig = checkpoint_kinds()[kind]
    stored, reference = packer(weight(), np.random.default_rng(1))
    gq = read_one(fmt_of(qconfig), write(tmp_path, stored))
    np.testing.assert_array_equal(gq.dequantize(), reference.T)
    assert (gq.g_idx is not None) == ("act_order" in kind or "actorder" in kind)


def test_codes_and_zeros_in_range_and_8bit_gptq_desc_act(tmp_path):
    stored, reference = pack_gptq(weight(), 8, 16, False, True, np.random.default_rng(2))
    gq = read_one(gptq_format(gptq_config(8, 16, False, True)), write(tmp_path, stored))
    np.testing.assert_array_equal(gq.dequantize(), reference.T)
    assert gq.q.dtype == np.uint8 and gq.q.max() > 15 and gq.zero.min() >= 1


def refusal(tmp_path, fmt, stored: dict, match: str):
    with pytest.raises(ValueError, match=match):
        check_linears(fmt, [(PREFIX, NUM_IN, NUM_OUT)], headers(write(tmp_path, stored)))


def test_awq_wrong_packing_width_refused(tmp_path):
    stored, _ = pack_awq(weight(), 32)
    stored["qweight"] = pack(np.zeros((NUM_IN, NUM_OUT), np.int64), 8, axis=1)  # 4 codes per word
    refusal(tmp_path, fmt_of(checkpoint_kinds()["awq"][1]), stored, rf"'{PREFIX}.qweight' has shape \[64, 12\]")


def test_missing_zeros_refused(tmp_path):
    stored, _ = pack_awq(weight(), 32)
    del stored["qzeros"]
    refusal(tmp_path, fmt_of(checkpoint_kinds()["awq"][1]), stored, rf"'{PREFIX}.qzeros' is missing")
    stored, _ = pack_compressed(weight(), 4, 16, False, True, np.random.default_rng(0))
    del stored["weight_zero_point"]
    fmt = pack_quantized_format(compressed_config(4, 16, False, True))
    refusal(tmp_path, fmt, stored, rf"'{PREFIX}.weight_zero_point' is missing")


def test_missing_g_idx_with_desc_act_refused(tmp_path):
    stored, _ = pack_gptq(weight(), 4, 16, False, True, np.random.default_rng(0))
    del stored["g_idx"]
    refusal(tmp_path, gptq_format(gptq_config(4, 16, False, True)), stored, rf"'{PREFIX}.g_idx' is missing")


def test_group_size_not_dividing_input_refused(tmp_path):
    stored, _ = pack_gptq(weight(), 4, 16, True, False, None)
    refusal(
        tmp_path, gptq_format(gptq_config(4, 24, True, False)), stored, f"{PREFIX}: .*group_size=24 does not divide"
    )


def test_mismatched_shapes_and_dtypes_refused(tmp_path):
    stored, _ = pack_gptq(weight(), 4, 16, True, False, None)  # 4 groups
    fmt = gptq_format(gptq_config(4, 32, True, False))  # config says 2
    refusal(tmp_path, fmt, stored, rf"'{PREFIX}.qzeros' has shape \[4, 6\], expected \[2, 6\]")
    stored, _ = pack_compressed(weight(), 4, 32, True, False, None)
    stored["weight_packed"] = stored["weight_packed"].to(torch.float32)
    fmt = pack_quantized_format(compressed_config(4, 32, True, False))
    refusal(tmp_path, fmt, stored, rf"'{PREFIX}.weight_packed' is stored as F32, expected I32")


def test_gptq_contradicting_config_refused_when_read(tmp_path):
    stored, _ = pack_gptq(weight(), 4, 16, False, False, None)  # asymmetric zeros
    with pytest.raises(ValueError, match=rf"'{PREFIX}.qzeros' holds zero points other than 8 .* sym=true"):
        read_one(gptq_format(gptq_config(4, 16, True, False)), write(tmp_path, stored))
    stored, _ = pack_gptq(weight(), 4, 16, True, True, np.random.default_rng(0))  # shuffled g_idx
    with pytest.raises(ValueError, match=rf"'{PREFIX}.g_idx' reorders .* desc_act=false"):
        read_one(gptq_format(gptq_config(4, 16, True, False)), write(tmp_path, stored))


def test_gptq_v1_all_ones_zero_field_reads_as_two_to_the_bits(tmp_path):
    """AutoGPTQ's v1 packer stores a zero point of 0 as -1 (all ones); its dequantizer masks the
    field and adds one, reading 16 for 4 bits. The reader keeps that value; 8 bits' 256 does not
    fit a uint8 zero point and is refused."""
    stored, _ = pack_gptq(weight(), 4, 32, False, False, None)
    stored["qzeros"] = torch.full_like(stored["qzeros"], -1)
    gq = read_one(gptq_format(gptq_config(4, 32, False, False)), write(tmp_path, stored))
    assert (gq.zero == 16).all()
    stored, _ = pack_gptq(weight(), 8, 32, False, False, None)
    stored["qzeros"] = torch.full_like(stored["qzeros"], -1)
    with pytest.raises(ValueError, match=rf"'{PREFIX}.qzeros' stores -1 for an 8-bit zero point"):
        read_one(gptq_format(gptq_config(8, 32, False, False)), write(tmp_path, stored))


def test_weight_shape_checked(tmp_path):
    stored, _ = pack_compressed(weight(), 4, 32, True, False, None)
    stored["weight_shape"] = torch.tensor([NUM_OUT, NUM_IN - 8])
    with pytest.raises(ValueError, match=rf"'{PREFIX}.weight_shape' says \[48, 56\]"):
        read_one(pack_quantized_format(compressed_config(4, 32, True, False)), write(tmp_path, stored))


@pytest.mark.parametrize(
    "parse, qconfig, match",
    [
        (awq_format, {"bits": 4, "group_size": 128, "version": "gemv"}, "version='gemv'"),
        (awq_format, {"w_bit": 3, "q_group_size": 128, "version": "GEMM"}, "w_bit=3"),
        (awq_format, {"bits": 4, "group_size": 128, "modules_to_not_convert": "gate"}, "modules_to_not_convert"),
        (gptq_format, {"bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}, "checkpoint_format='gptq_v2'"),
        (gptq_format, {"bits": 3, "group_size": 128}, "bits=3"),
        (gptq_format, {"bits": 4, "group_size": 0}, "group_size=0"),
        (gptq_format, {"bits": 4, "group_size": 128, "lm_head": True}, "lm_head=True"),
        (pack_quantized_format, {**compressed_config(4, 128, True, False), "format": "int-quantized"}, "format="),
        (
            pack_quantized_format,
            {
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4, "strategy": "tensor"}}},
            },
            r"config_groups.g.weights.strategy='tensor'",
        ),
    ],
)
def test_config_refusals_name_the_field(parse, qconfig, match):
    with pytest.raises(CheckpointQuantizationError, match=match):
        parse(qconfig)


def test_config_fields():
    assert awq_format({"w_bit": 4, "q_group_size": 128, "zero_point": True, "version": "GEMM"}).group_size == 128
    fmt = gptq_format(gptq_config(8, None, False, True))
    assert (fmt.bits, fmt.group_size, fmt.sym, fmt.act_order) == (8, None, False, True)
    fmt = pack_quantized_format(compressed_config(4, None, True, True))  # act order means nothing per channel
    assert (fmt.group_size, fmt.act_order) == (None, False)


def test_tiny_checkpoint_linears(tmp_path):
    """Every projection of a tiny GPTQ act-order checkpoint reads back as the model it stands for."""
    model = save_int4_checkpoint("llama_gqa4", "gptq_act_order_asym", str(tmp_path))
    config = model_config_from_hf(model.config.to_dict())
    ckpt = SafetensorsCheckpoint(tmp_path)
    qconfig = checkpoint_kinds()["gptq_act_order_asym"][1]
    linears = quantized_linears(config)
    names, read_linear = linear_reader(fmt_of(qconfig), linears, ckpt, 16)
    assert len(linears) == 14 and not any(n.endswith(".weight") for n in names)
    for prefix, _, _ in linears:
        expected = model.get_submodule(prefix).weight.detach().numpy().T
        np.testing.assert_array_equal(read_linear(prefix).dequantize(), expected)


def test_channel_weights_regrouped_to_one_model_group_size(tmp_path):
    """One group per output channel differs between linears of different widths: they are read
    in the largest group size dividing every input width (`with_weight_groups`), the same weights."""
    model = save_int4_checkpoint("llama_gqa4", "compressed_channel", str(tmp_path))
    config = model_config_from_hf(model.config.to_dict()).with_weight_groups((4, None))
    linears = quantized_linears(config)
    fmt = fmt_of(checkpoint_kinds()["compressed_channel"][1])
    _, read_linear = linear_reader(fmt, linears, SafetensorsCheckpoint(tmp_path), config.weight_group_size)
    for prefix, num_in, _ in linears:
        gq = read_linear(prefix)
        assert gq.group_size == 64 and gq.scale.shape[0] == num_in // 64
        np.testing.assert_array_equal(gq.dequantize(), model.get_submodule(prefix).weight.detach().numpy().T)


def test_channel_weights_of_a_large_model_split_over_eight_devices():
    """8B's projections' inputs share 2048 as their largest divisor (7 MLP groups, which no tensor-
    parallel size splits); per-channel weights are held in groups of at most 128 instead."""
    config = model_config_from_hf(load_config_dict("llama-3.1-8b")[1]).with_weight_groups((4, None))
    assert config.weight_group_size == 128
    for n in (2, 4, 8):
        TensorParallelLayout(config, n)


def test_checkpoint_detection_and_quantization_assertion():
    """config.json's quantization_config names the format; `--quantization awq|gptq|compressed-tensors`
    asserts it (compressed-tensors also names an FP8 checkpoint), and a plain checkpoint has none."""
    awq = {"quantization_config": checkpoint_kinds()["awq"][1]}
    assert checkpoint_quantization(awq) == "awq" == resolve_quantization("awq", awq) == resolve_quantization(None, awq)
    gptq = {"quantization_config": gptq_config(4, 128, True, True)}
    assert checkpoint_group_format(gptq) == GroupFormat("gptq", 4, 128, True, True)
    with pytest.raises(ValueError, match="quantization='gptq': the checkpoint is already quantized as 'awq'"):
        resolve_quantization("gptq", awq)
    with pytest.raises(ValueError, match="quantization='awq': names a pre-quantized awq checkpoint, but config.json"):
        resolve_quantization("awq", {})
    fp8 = {"quantization_config": fp8_quantization_config()}
    assert resolve_quantization("compressed-tensors", fp8) == "fp8" and checkpoint_group_format(fp8) is None
    packed = {"quantization_config": compressed_config(4, 128, True, False)}
    assert resolve_quantization("compressed-tensors", packed) == "compressed-tensors"


def test_compressed_tensors_ignore_matches_names_whole_or_by_regex():
    """compressed-tensors' `ignore` names a module whole, or by a regular expression matched from
    the name's start after `re:` (not as AWQ's substrings); anything else is refused naming it."""
    qconfig = compressed_config(4, 32, True, False)
    fmt = pack_quantized_format({**qconfig, "ignore": ["lm_head", "re:.*mlp[.]gate$", "model.layers.1.mlp.up_proj"]})
    assert fmt.not_converted_field == "ignore"
    assert fmt.leaves_float("model.layers.7.mlp.gate") and fmt.leaves_float("model.layers.1.mlp.up_proj")
    assert not fmt.leaves_float("model.layers.7.mlp.gate_proj")  # the regex's $: no substring match
    assert not fmt.leaves_float("model.layers.11.mlp.up_proj") and not fmt.leaves_float("lm_head.x")
    assert awq_format({**checkpoint_kinds()["awq"][1], "modules_to_not_convert": ["gate"]}).leaves_float(
        "model.layers.7.mlp.gate_proj"
    )  # AWQ: a substring
    for bad, match in (("lm_head", "must be a list"), (["re:(["], "is not a regular expression"), ([""], "must be")):
        with pytest.raises(ValueError, match=rf"ignore.*{match}"):
            pack_quantized_format({**qconfig, "ignore": bad})
