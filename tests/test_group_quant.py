"""Group-quantized (4/8-bit) weights: storage, the matmul, round-to-nearest int4 at load, the
reader hook, tensor parallelism.

- A reader's `GroupQuantized` becomes state arrays that mean exactly its weight (`group_state`),
  and `group_matmul` equals a float64 product with that weight on both of its paths (per-group
  partials for few tokens, a dequantized temporary for many).
- `--quantization int4` on a tiny Llama: every weight within half a step of its group's scale;
  logits equal transformers' run on the dequantized weights (float32, tight) and greedy tokens
  equal its greedy tokens.
- GPTQ `desc_act`: a tiny Llama quantized by an independent act-order packer (shuffled `g_idx`,
  asymmetric zeros) and built through the reader hook (`group_tensors`) gives the logits and
  greedy tokens of transformers on its dequantized weights.
- `jaxpaged-convert --quantization int4` writes the arrays quantizing at load makes, records
  the groups in config.json (loading needs no flag), and another method or group size is refused.
- Bad group sizes and tensor-parallel sizes that would split a group name both numbers.
- Tensor parallelism over 2 and 4 fake devices gives the unsharded tokens, scales and zeros split
  beside their weights.
- `jaxpaged plan` counts the codes, scales and zero points, and fits Llama-3.1-70B on one 80 GB GPU.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import tp_workload
from checkpoint_edits import copy_checkpoint
from flax import nnx
from tiny_models import save_hf_model

import jaxpaged.model.llama as llama_model
import jaxpaged.model.quant as quant
from jaxpaged.checkpoint.convert import convert_checkpoint
from jaxpaged.checkpoint.group_quant import GroupQuantized
from jaxpaged.checkpoint.group_state import group_state, group_tensors
from jaxpaged.checkpoint.loader import load_model, load_params, read_hf_config
from jaxpaged.config.architectures import llama
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs, EngineArgsError
from jaxpaged.engine_config import EngineConfig
from jaxpaged.entrypoints.convert_cli import main as convert_main
from jaxpaged.model import LayerArrays
from jaxpaged.model.group_quant import code_dtype, group_matmul
from jaxpaged.model.llama import Llama
from jaxpaged.parallel.mesh import param_path
from jaxpaged.parallel.sharding import TensorParallelError, TensorParallelLayout
from jaxpaged.planning.plan import make_plan
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.paged_generate import PagedGenerator

GROUP_SIZE = 32
# Prompts of the tiny int4 model: 9 tokens take the per-group partials, 70 a dequantized weight.
INT4_PROMPTS = [np.random.default_rng(0).integers(3, 512, n).tolist() for n in (9, 70)]
# Our (module, weight) -> the HF linear's name in a decoder layer.
HF_NAMES = {
    ("attn", "q_proj"): "self_attn.q_proj",
    ("attn", "k_proj"): "self_attn.k_proj",
    ("attn", "v_proj"): "self_attn.v_proj",
    ("attn", "o_proj"): "self_attn.o_proj",
    ("mlp", "gate_proj"): "mlp.gate_proj",
    ("mlp", "up_proj"): "mlp.up_proj",
    ("mlp", "down_proj"): "mlp.down_proj",
}


def dequantize(codes, scale, zero, num_in: int) -> np.ndarray:
    """The float64 weight `[*in, *out]` of one layer's state triple, written from the layout's
    description (signed codes and zeros; groups of the flattened inputs)."""
    codes, scale, zero = (np.asarray(a).astype(np.float64) for a in (codes, scale, zero))
    ins, outs = codes.shape[:num_in], codes.shape[num_in:]
    num_in_features, groups = int(np.prod(ins)), scale.shape[0]
    q = codes.reshape(groups, num_in_features // groups, -1)
    w = (q - zero.reshape(groups, 1, -1)) * scale.reshape(groups, 1, -1)
    return w.reshape(*ins, *outs)


def random_group_quantized(rng, num_in: int, num_out: int, bits: int, group_size: int) -> GroupQuantized:
    groups = num_in // group_size
    top = 2**bits
    return GroupQuantized(
        q=rng.integers(0, top, (num_in, num_out)).astype(np.uint8),
        scale=rng.uniform(0.01, 0.1, (groups, num_out)).astype(np.float32),
        zero=rng.integers(0, top, (groups, num_out)).astype(np.uint8),
        g_idx=None,
        bits=bits,
        group_size=group_size,
    )


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("num_tokens", [3, 40])  # 3: per-group partials; 40: a dequantized temporary
def test_a_readers_weight_becomes_state_the_matmul_reads_exactly(bits, num_tokens):
    config = ModelConfig("llama", 512, 64, 96, 1, 4, 2, 16).with_weight_groups((bits, 16))
    o_proj = next(s for s in llama.PARAMS if s.name == "o_proj")  # inputs (heads, head_dim): 4 x 16 -> 4 groups
    rng = np.random.default_rng(bits)
    gq = random_group_quantized(rng, 64, 64, bits, 16)
    codes, scale, zero = group_state(gq, o_proj, config, "model.layers.0.self_attn.o_proj")
    assert codes.shape == (4, 16, 64) and scale.shape == zero.shape == (4, 64)
    assert codes.dtype == code_dtype(bits)
    np.testing.assert_allclose(dequantize(codes, scale, zero, 2).reshape(64, 64), gq.dequantize(), rtol=1e-6)
    x = rng.normal(size=(num_tokens, 4, 16)).astype(np.float32)
    y = group_matmul(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scale), jnp.asarray(zero), 2)
    np.testing.assert_allclose(np.asarray(y), x.reshape(num_tokens, 64) @ gq.dequantize(), rtol=1e-5, atol=1e-4)
    shuffled = GroupQuantized(gq.q, gq.scale, gq.zero, rng.permutation(np.arange(64) // 16), bits, 16)
    with pytest.raises(ValueError, match="q_proj: .*desc_act"):
        group_state(shuffled, o_proj, config, "model.layers.0.self_attn.q_proj")
    # desc_act: the inputs stored sorted by group, the activation gathered by the permutation
    act_order = config.with_weight_groups((bits, 16), act_order=True)
    codes, scale, zero, perm = group_state(shuffled, o_proj, act_order, "model.layers.0.self_attn.o_proj")
    assert sorted(perm) == list(range(64)) and perm.dtype == np.int32
    y = group_matmul(*(jnp.asarray(a) for a in (x, codes, scale, zero)), 2, jnp.asarray(perm))
    np.testing.assert_allclose(np.asarray(y), x.reshape(num_tokens, 64) @ shuffled.dequantize(), rtol=1e-5, atol=1e-4)
    uneven = GroupQuantized(gq.q, gq.scale, gq.zero, np.minimum(np.arange(64) // 8, 3), bits, 16)
    with pytest.raises(ValueError, match="o_proj: g_idx does not put exactly 16 inputs in each group"):
        group_state(uneven, o_proj, act_order, "model.layers.0.self_attn.o_proj")


def pack_act_order(weight: np.ndarray, rng, group_size: int) -> GroupQuantized:
    """An independent act-order quantizer: HF `weight [out, in]` in groups of a shuffled `g_idx`,
    asymmetric 4-bit min-max codes (written from GPTQ's description, not the loader's code)."""
    w = weight.T.astype(np.float64)  # [in, out]
    g_idx = rng.permutation(np.arange(w.shape[0]) // group_size)
    groups = w.shape[0] // group_size
    scale, zero = np.empty((groups, w.shape[1])), np.empty((groups, w.shape[1]))
    for g in range(groups):
        rows = w[g_idx == g]
        lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
        scale[g] = (hi - lo) / 15
        zero[g] = np.round(-lo / scale[g])
    q = np.clip(np.round(w / scale[g_idx]) + zero[g_idx], 0, 15)
    return GroupQuantized(
        q.astype(np.uint8), scale.astype(np.float32), zero.astype(np.uint8), g_idx.astype(np.int32), 4, group_size
    )


def test_a_desc_act_model_from_the_reader_hook_equals_its_dequantized_float_model(tmp_path):
    path = str(tmp_path)
    hf = save_hf_model("llama_hd64", path)
    rng = np.random.default_rng(1)
    weights = {}  # HF prefix -> its GroupQuantized
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.endswith(tuple(HF_NAMES.values())):
                weights[name] = pack_act_order(module.weight.numpy(), rng, GROUP_SIZE)
                module.weight.copy_(torch.tensor(weights[name].dequantize().T))
    config = read_hf_config(path)[0].with_weight_groups((4, GROUP_SIZE), act_order=True)
    params = load_params(path, "float32")[1]
    for path_, layer, array in group_tensors(config, weights.__getitem__):  # the hook, layer by layer
        stacked = params["layers"][path_[1]].setdefault(
            path_[2], np.empty((config.num_layers, *array.shape), array.dtype)
        )
        stacked[layer] = array
    for module, name in HF_NAMES:
        del params["layers"][module][name]
    model = Llama(config, jnp.float32, rngs=nnx.Rngs(0), quantization="int4", scan_layers=True)
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    prompt = rng.integers(3, 512, 40).tolist()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].numpy()
    generator = PagedGenerator(model)
    np.testing.assert_allclose(generator.prompt_logits(prompt), reference, atol=2e-4)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert generator.generate([prompt], 8)[0] == expected[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def tiny_int4(tmp_path_factory):
    """(the transformers model, the int4 model, the per-layer state) of llama_hd64 at group size 32."""
    path = str(tmp_path_factory.mktemp("int4_tiny"))
    hf = save_hf_model("llama_hd64", path)
    config, model = load_model(path, "float32", quantization="int4", quantization_group_size=GROUP_SIZE)
    assert (config.weight_bits, config.weight_group_size) == (4, GROUP_SIZE)
    return path, hf, model


def test_int4_logits_and_greedy_tokens_equal_the_dequantized_float_model(tiny_int4):
    _, hf, model = tiny_int4
    layers = nnx.state(model).to_pure_dict()["layers"]
    num_in = {"o_proj": 2}
    with torch.no_grad():
        for (module, name), hf_name in HF_NAMES.items():
            triple = [layers[module][name + suffix] for suffix in ("_quant", "_scale", "_zero")]
            for i in range(hf.config.num_hidden_layers):
                codes, scale, zero = (a.arrays[i] for a in triple)
                inputs = int(np.prod(codes.shape[: num_in.get(name, 1)]))
                assert codes.dtype == code_dtype(4) and scale.shape[0] == inputs // GROUP_SIZE
                weight = dequantize(codes, scale, zero, num_in.get(name, 1)).reshape(inputs, -1)  # [in, out]
                torch_weight = hf.get_submodule(f"model.layers.{i}.{hf_name}").weight
                step = np.repeat(np.asarray(scale).reshape(scale.shape[0], -1), GROUP_SIZE, axis=0)
                assert np.all(np.abs(weight - torch_weight.numpy().T) <= step / 2 + 1e-6)  # round to nearest
                torch_weight.copy_(torch.tensor(weight.T))
    generator = PagedGenerator(model)
    for prompt in INT4_PROMPTS:
        with torch.no_grad():
            reference = hf(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(generator.prompt_logits(prompt), reference, atol=2e-4)
    tokens = generator.generate(INT4_PROMPTS, 12)
    with torch.no_grad():
        for prompt, got in zip(INT4_PROMPTS, tokens):
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
            assert got == out[0, len(prompt) :].tolist()


def test_convert_quantizes_to_int4_records_the_groups_and_loads_back_the_same_model(tiny_int4, tmp_path):
    """`jaxpaged-convert --quantization int4` writes the arrays `--quantization int4` makes at load;
    the directory loads with no flag, and a different method or group size is refused."""
    path, _, model = tiny_int4
    out = tmp_path / "int4"
    args = ["--hf-dir", path, "--out", str(out), "--dtype", "float32", "--no-progress", "--quantization", "int4"]
    assert convert_main(args + ["--quantization-group-size", str(GROUP_SIZE)]) == 0
    recorded = {"quant_method": "jaxpaged", "method": "int4", "bits": 4, "group_size": GROUP_SIZE}
    assert json.loads((out / "config.json").read_text())["quantization_config"] == recorded
    assert json.loads((out / "jaxpaged_format.json").read_text())["quantization"] == "int4"
    config, converted = load_model(str(out))  # no flags: float32 ("auto"), int4 in groups of 32
    assert (config.weight_bits, config.weight_group_size) == (4, GROUP_SIZE)
    expected, got = nnx.to_pure_dict(nnx.state(model)), nnx.to_pure_dict(nnx.state(converted))
    assert jax.tree.structure(expected) == jax.tree.structure(got)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    # the first program is the previous test's when it ran in this process (the same model and shapes)
    assert PagedGenerator(model).generate(INT4_PROMPTS, 12) == PagedGenerator(converted).generate(INT4_PROMPTS, 12)

    with pytest.raises(
        EngineArgsError, match=r"quantization_group_size=64: the weights were quantized in groups of 32"
    ):
        EngineConfig.resolve(EngineArgs(model=str(out), quantization_group_size=64, skip_tokenizer_init=True))
    with pytest.raises(ValueError, match=r"quantization='int8': the checkpoint is already quantized as 'int4'"):
        load_model(str(out), quantization="int8")
    with pytest.raises(ValueError, match=r"--quantization-group-size 64: sets the groups of --quantization int4"):
        convert_checkpoint(path, tmp_path / "plain", quantization_group_size=64, progress=False)
    hf_dir = copy_checkpoint(path, tmp_path / "hf")  # safetensors beside the converted config.json
    (hf_dir / "config.json").write_text((out / "config.json").read_text())
    with pytest.raises(
        ValueError, match=r"jaxpaged-convert quantized the weights \(int4\), but the directory holds no"
    ):
        load_params(hf_dir)
    edited = json.loads((out / "config.json").read_text())
    edited["quantization_config"]["group_size"] = 64  # the stored scales hold groups of 32
    (out / "config.json").write_text(json.dumps(edited))
    with pytest.raises(
        ValueError, match=r"tensor 'layers\.attn\.\w+_scale' has shape \[2, 4, [0-9, ]*\], expected \[2, 2, "
    ):
        load_params(out)


def test_group_sizes_and_tensor_parallel_sizes_that_split_a_group_are_refused(tiny_int4):
    path = tiny_int4[0]
    with pytest.raises(EngineArgsError, match=r"quantization_group_size.*48.*does not divide hidden_size=128"):
        LLMEngine(EngineArgs(model=path, quantization="int4", quantization_group_size=48, skip_tokenizer_init=True))
    config = read_hf_config(path)[0].with_weight_groups((4, 64))  # MLP width 128: 2 groups of 64
    with pytest.raises(TensorParallelError, match=r"tensor_parallel_size=4 .*mlp inputs hold 2 groups of 64"):
        TensorParallelLayout(config, 4)
    TensorParallelLayout(config, 2)


@pytest.fixture(scope="module")
def llama_tp_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("llama_tp"))
    save_hf_model("llama_tp", path)  # hidden 64, heads 8 x 8, MLP 128; groups of 16: 4, 4 and 8 per input
    return path


@pytest.fixture(scope="module")
def one_device_int4_tokens() -> dict:
    """kernel -> the one-device int4 engine's tokens: the same reference for every n, so each is
    computed (and its kernel calls checked) once."""
    return {}


# 4 devices: each of llama_tp's 2 kv heads on 2 devices; 4 groups per split input
@pytest.mark.parametrize("n, kernel", [(2, False), (4, False), (2, True), (4, True)])
def test_tensor_parallel_int4_gives_the_unsharded_tokens_with_groups_beside_their_weights(
    llama_tp_dir, one_device_int4_tokens, monkeypatch, n, kernel
):
    """TP n gives the one-device engine's tokens, through XLA's product or (`kernel`, as on a GPU)
    the Pallas kernel on every device over its shard (interpreted here): every projection of
    every step goes through it, the one-device engine's through the same kernel unsplit."""
    calls = []
    if kernel:
        monkeypatch.setattr(llama_model, "use_group_kernel", lambda parallel: True)
        real = quant.kernel_on_every_device
        monkeypatch.setattr(quant, "kernel_on_every_device", lambda *args: calls.append(args[2]) or real(*args))
    path = llama_tp_dir
    prompts = tp_workload.prompts()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens(size):
        options = {**tp_workload.engine_options(path, size), "quantization": "int4", "quantization_group_size": 16}
        engine = LLMEngine(EngineArgs(**options))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        done = {}
        while engine.has_unfinished_requests():
            done.update((int(o.request_id), o.outputs[0].token_ids) for o in engine.step() if o.finished)
        return [done[i] for i in range(len(prompts))], engine

    if kernel not in one_device_int4_tokens:
        one_device_int4_tokens[kernel] = tokens(1)[0]
        assert not calls  # one device: the kernel unsplit
    single = one_device_int4_tokens[kernel]
    split, engine = tokens(n)
    assert split == single
    if kernel:  # traced once per program: 7 projections of each of llama_tp's layers
        assert {c.removesuffix("_quant") for c in calls} == {
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        }

    def layer0(entry):
        [arrays] = jax.tree.leaves(entry, is_leaf=lambda x: isinstance(x, LayerArrays))
        return arrays.arrays[0]

    layers, checked = engine.runner.params["layers"], 0
    for path_, leaf in jax.tree_util.tree_flatten_with_path(layers, is_leaf=lambda x: isinstance(x, LayerArrays))[0]:
        module, name = param_path(path_)[0], param_path(path_)[-1]
        if name.endswith(("_scale", "_zero")):  # groups split where the weight's first input axis is
            array, codes = layer0(leaf), layer0(layers[module][name.rsplit("_", 1)[0] + "_quant"])
            assert array.sharding.spec[0] == codes.sharding.spec[0], name
            assert array.sharding.spec[1:] == codes.sharding.spec[codes.ndim - array.ndim + 1 :], name
            checked += 1
    assert checked == 14  # q, k, v, o, gate, up, down: scale and zero


def test_plan_counts_4_bit_codes_scales_and_zeros_and_fits_70b_on_one_gpu():
    report = make_plan("llama-3.1-70b", gpu_memory=80 * 10**9, context=8192, dtype="bfloat16", quantization="int4")
    d, f, kv, layers, vocab = 8192, 28672, 8 * 128, 80, 128256
    projections = layers * (2 * d * d + 2 * d * kv + 3 * d * f)  # q, o; k, v; gate, up, down
    plain = 2 * (2 * vocab * d + (2 * layers + 1) * d)  # embedding, LM head, norms in bfloat16
    assert report["weight_bytes_per_gpu"] == projections // 2 + projections // 128 * (4 + 1) + plain
    assert report["fits"] and report["max_concurrency"] > 10
    with pytest.raises(ValueError, match="quantization_group_size=96: does not divide"):
        make_plan("llama-3.1-8b", gpu_memory=80 * 10**9, quantization="int4", quantization_group_size=96)
