"""4/8-bit checkpoints end to end: tiny Llama checkpoints in the AWQ, GPTQ and compressed-tensors
pack-quantized layouts (built by tests/int4_checkpoints.py's independent packers) load with their
weights group-quantized on the device, detected from config.json, and their logits and greedy tokens
equal transformers' run on the packer's dequantized weights; a bad file is refused from its
headers naming the tensor, and `--quantization` asserts the format; `jaxpaged-convert` keeps them
4-bit (int4 codes in the Orbax tree) and the converted directory loads as the same arrays; under
tensor parallelism an AWQ and a GPTQ act-order checkpoint load into their shards and give the
dequantized model's tokens."""

import json

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import tp_workload
from checkpoint_edits import copy_checkpoint, edit_tensors
from engine_fixtures import hf_greedy
from int4_checkpoints import save_int4_checkpoint, write_int4_checkpoint
from shard_checks import check_loaded_into_shards
from tiny_models import build_hf_model

from jaxpaged.checkpoint.convert import convert_checkpoint
from jaxpaged.checkpoint.format import PARAMS_DIR
from jaxpaged.checkpoint.loader import load_model, load_params
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs, EngineArgsError
from jaxpaged.engine_config import EngineConfig
from jaxpaged.entrypoints.convert_cli import main as convert_main
from jaxpaged.model.group_quant import code_dtype
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.paged_generate import PagedGenerator

VARIANT = "llama_gqa4"  # hidden 64, o_proj inputs 8 x 16 = 128, MLP 128
PROMPTS = [np.random.default_rng(0).integers(3, 512, n).tolist() for n in (9, 40)]
# kind -> (bits, the model's group size) of the checkpoints run end to end (one of each format; a
# channel-wise checkpoint is held in groups of 64, the largest size dividing every projection's
# inputs); every kind dequantizes exactly at the reader's level (test_int4_formats.py)
KINDS = {
    "awq": (4, 32),
    "gptq_act_order_asym": (4, 16),  # desc_act: a shuffled g_idx, asymmetric zeros
    "gptq_8bit_channel": (8, 64),
    "compressed_channel": (4, 64),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (directory, the dequantized transformers model)."""
    root = tmp_path_factory.mktemp("int4")
    kinds = [*KINDS, "gptq_sym"]
    return {kind: (str(root / kind), save_int4_checkpoint(VARIANT, kind, str(root / kind))) for kind in kinds}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_logits_and_greedy_tokens_equal_the_dequantized_model(checkpoints, kind):
    path, hf = checkpoints[kind]
    config, model = load_model(path, "float32")
    assert (config.weight_bits, config.weight_group_size) == KINDS[kind]
    assert config.weight_act_order == ("act_order" in kind)
    generator = PagedGenerator(model)
    with torch.no_grad():
        for prompt in PROMPTS:
            reference = hf(torch.tensor([prompt])).logits[0].numpy()
            np.testing.assert_allclose(generator.prompt_logits(prompt), reference, atol=2e-4)
        for prompt, got in zip(PROMPTS, generator.generate(PROMPTS, 10)):
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
            assert got == out[0, len(prompt) :].tolist()


def test_bad_files_refused_from_headers_naming_the_tensor(checkpoints, tmp_path):
    path = copy_checkpoint(checkpoints["awq"][0], tmp_path / "no_zeros")
    edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.up_proj.qzeros"))
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.up_proj\.qzeros' is missing"):
        load_model(path, "float32")
    path = copy_checkpoint(checkpoints["gptq_sym"][0], tmp_path / "wide")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["bits"] = 8  # the words hold 8 4-bit codes, not 4 8-bit ones
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.qweight' has shape \[8, 128\]"):
        load_model(path, "float32")


def test_quantization_option_asserts_the_format(checkpoints, tmp_path):
    path = checkpoints["gptq_sym"][0]
    assert EngineConfig.resolve(EngineArgs(model=path, quantization="gptq", skip_tokenizer_init=True))
    with pytest.raises(EngineArgsError, match="already quantized as 'gptq'"):
        EngineConfig.resolve(EngineArgs(model=path, quantization="awq", skip_tokenizer_init=True))
    with pytest.raises(ValueError, match="--quantization int4: the checkpoint is already quantized as gptq"):
        convert_checkpoint(path, tmp_path / "out", progress=False, quantization="int4")
    config, params = load_params(path)  # numpy, in the model state's layout
    codes = params["layers"]["attn"]["q_proj_quant"]
    assert config.weight_group_size == 32 and codes.dtype == code_dtype(4) and codes.shape == (2, 64, 8, 16)


def stored_dtypes(converted) -> dict[str, np.dtype]:
    """The dtype of each array of layer 0's q_proj as the converted directory's Orbax tree stores it."""
    with ocp.PyTreeCheckpointer() as checkpointer:
        meta = checkpointer.metadata(str(converted / PARAMS_DIR))
    attn = getattr(getattr(meta, "item_metadata", meta), "tree", meta)["layers"]["attn"]
    return {name: np.dtype(m.dtype) for name, m in attn.items() if name.startswith("q_proj")}


# greedy tokens once, of the act-ordered model (~10 s of compiling); identical arrays are the same model
@pytest.mark.parametrize("kind, check_tokens", [("awq", False), ("gptq_act_order_asym", True)])
def test_convert_keeps_the_checkpoint_4_bit_and_loads_it_back_the_same(checkpoints, kind, check_tokens, tmp_path):
    """jaxpaged-convert writes the model state's group-quantized arrays, codes as int4; the
    converted directory reads (no flag) into the same arrays and greedy tokens as the checkpoint."""
    path, hf = checkpoints[kind]
    out = tmp_path / "converted"
    assert convert_main(["--hf-dir", path, "--out", str(out), "--dtype", "float32", "--no-progress"]) == 0
    assert json.loads((out / "jaxpaged_format.json").read_text())["quantization"] == kind.split("_")[0]
    expected = {"q_proj_quant": ml_dtypes.int4, "q_proj_scale": np.float32, "q_proj_zero": np.int8}
    expected |= {"q_proj_perm": np.int32} if "act_order" in kind else {}
    assert stored_dtypes(out) == {name: np.dtype(dtype) for name, dtype in expected.items()}
    (config, converted), (_, original) = load_params(out), load_params(path)
    assert config.weight_act_order == ("act_order" in kind)
    for module, arrays in original["layers"].items():
        for name, array in arrays.items():
            assert converted["layers"][module][name].dtype == array.dtype, name
            np.testing.assert_array_equal(converted["layers"][module][name], array, err_msg=name)
    if not check_tokens:
        return
    _, model = load_model(str(out), "float32")
    with torch.no_grad():
        reference = hf.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert PagedGenerator(model).generate(PROMPTS[:1], 8)[0] == reference[0, len(PROMPTS[0]) :].tolist()


@pytest.mark.parametrize("kind, n", [("awq", 2), ("gptq_act_order_asym", 4)])
def test_tensor_parallel_loads_the_checkpoint_into_its_shards_and_gives_its_tokens(tmp_path, kind, n):
    """llama_tp (hidden 64, heads 8 x 8, 2 kv heads, MLP 128) in groups of 16 (act order: 8, a
    shuffled g_idx): on `n` devices every array (codes, scales, zeros, permutations), from
    safetensors and from its jaxpaged-convert directory, lands split as the table says, holding
    the one-device values (kv heads repeated at 4), and the engine gives the dequantized model's
    greedy tokens (prefix caching, chunked prefill and preemption on)."""
    path = str(tmp_path)
    hf = write_int4_checkpoint(build_hf_model("llama_tp"), kind, path, group_size=16)
    converted = str(tmp_path / "converted")
    convert_checkpoint(path, converted, dtype="float32", progress=False)
    config, single = load_model(path, "float32", scan_layers=True)
    assert config.weight_act_order == ("act_order" in kind)
    check_loaded_into_shards(  # Orbax restores the converted codes (int4 on disk) into their shards
        (path, converted),
        TensorParallel.create(config, n),
        single,
        lambda leaf, expected, message: np.testing.assert_array_equal(np.asarray(leaf), expected, message),
    )
    engine = LLMEngine(EngineArgs(**tp_workload.engine_options(path, n)))
    prompts, params = tp_workload.prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((int(o.request_id), o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert [done[i] for i in range(len(prompts))] == [hf_greedy(hf, prompt, 12) for prompt in prompts]
    assert engine.get_stats()["num_preemptions"] > 0
