"""Pre-quantized checkpoints: compressed-tensors FP8 (float8_e4m3fn `weight` + `weight_scale`,
`quantization_config` in config.json), built locally from tiny random models (fp8_checkpoint.py).

They load with their fp8 bytes unchanged, run the model transformers runs on the dequantized
weights, start an engine as fp8 without being asked, fail on a bad file from its headers alone,
and survive `jaxpaged-convert`.
"""

import json

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from checkpoint_edits import copy_checkpoint, edit_tensors
from flax import nnx
from fp8_checkpoint import PROJECTIONS, save_fp8_checkpoint
from safetensors.torch import load_file, save_file
from shard_checks import check_loaded_into_shards
from tiny_models import save_hf_model
from tiny_tokenizer import save_tokenizer

from jaxpaged.checkpoint.convert import convert_checkpoint
from jaxpaged.checkpoint.hf_keys import param_shapes
from jaxpaged.checkpoint.loader import load_model, load_params
from jaxpaged.checkpoint.safetensors_index import SafetensorsCheckpoint
from jaxpaged.config.hf_config import read_model_config
from jaxpaged.config.quantization import CheckpointQuantizationError
from jaxpaged.engine_args import EngineArgs, EngineArgsError
from jaxpaged.engine_config import EngineConfig
from jaxpaged.entrypoints.convert_cli import main as convert_main
from jaxpaged.parallel.mesh import TensorParallel, param_path
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.paged_generate import PagedGenerator

VARIANT = "llama_gqa4"  # 8 query heads over 2 kv heads, head_dim 16: q [128, 64] -> [8, 16, 64]
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 512, 40)]
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
# Our path of each HF projection (decoder layers stacked: row i is layer i).
TARGETS = {
    "self_attn.q_proj": ("attn", "q_proj"),
    "self_attn.k_proj": ("attn", "k_proj"),
    "self_attn.v_proj": ("attn", "v_proj"),
    "self_attn.o_proj": ("attn", "o_proj"),
    "mlp.gate_proj": ("mlp", "gate_proj"),
    "mlp.up_proj": ("mlp", "up_proj"),
    "mlp.down_proj": ("mlp", "down_proj"),
}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The plain checkpoint and two FP8 checkpoints made from the same weights: per output
    channel (float32 scales `[out, 1]`, activations dynamic, with a tokenizer so an engine can
    start), and per tensor (bfloat16 scales `[]`, static `input_scale` `[1]` and KV cache scales,
    which are checked and dropped). Values: the dequantized torch models."""
    root = tmp_path_factory.mktemp("fp8")
    plain = save_hf_model(VARIANT, str(root / "plain"))
    channel = save_fp8_checkpoint(VARIANT, str(root / "channel"))
    save_tokenizer(str(root / "channel"), 512)
    tensor = save_fp8_checkpoint(
        VARIANT, str(root / "tensor"), strategy="tensor", static_input=True, kv_cache=True, scale_dtype=torch.bfloat16
    )
    return {
        "plain": (root / "plain", plain),
        "channel": (root / "channel", channel),
        "tensor": (root / "tensor", tensor),
    }


def state(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model))


def bits(x) -> np.ndarray:
    """An fp8 array's bytes (an exact comparison, NaN-safe)."""
    x = np.asarray(x)
    assert x.dtype == FP8, x.dtype
    return x.view(np.uint8)


def assert_same(a, b, msg: str = "") -> None:
    """The same dtype and the same values (fp8 compared byte for byte)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (msg, a.dtype, b.dtype)
    if a.dtype == FP8:
        a, b = a.view(np.uint8), b.view(np.uint8)
    np.testing.assert_array_equal(a, b, err_msg=msg)


def hf_logits(model, prompt=PROMPT) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].numpy()


def with_fp8_activations(model):
    """`model` with every projection's input quantized per token to float8_e4m3fn and back
    (scale amax / 448), as `jaxpaged.model.quant.quantized_matmul` does before its fp8 dot."""

    def hook(_, args):
        (x,) = args
        amax = x.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
        return ((x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float32) * scale,)

    handles = [
        model.get_submodule(f"model.layers.{i}.{proj}").register_forward_pre_hook(hook)
        for i in range(model.config.num_hidden_layers)
        for proj in PROJECTIONS
    ]
    return handles


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_fp8_bytes_and_scales_load_unchanged(dirs, strategy):
    """(a) Each projection's fp8 weight arrives byte for byte, only reshaped to `[*out, *in]`;
    its scale as float32 `[*out]` (a per-tensor one broadcast); the rest in the model's dtype."""
    path, _ = dirs[strategy]
    hf = load_file(str(path / "model.safetensors"))
    config, model = load_model(path, "bfloat16", scan_layers=True)  # no quantization argument: config.json says fp8
    params = state(model)
    assert "q_proj" not in params["layers"]["attn"]
    assert {p: tuple(v.shape) for p, v in _leaves(params).items()} == param_shapes(config, "fp8")
    for i in range(config.num_layers):
        for proj, (group, name) in TARGETS.items():
            weight, scale = hf[f"model.layers.{i}.{proj}.weight"], hf[f"model.layers.{i}.{proj}.weight_scale"]
            quant, ours = params["layers"][group][name + "_quant"][i], params["layers"][group][name + "_scale"][i]
            expected = weight.view(torch.uint8).numpy().reshape(quant.shape)  # HF [out, in] is outputs first
            np.testing.assert_array_equal(bits(quant), expected, err_msg=f"{i} {proj}")
            assert ours.dtype == np.float32
            scale = scale.to(torch.float32).numpy()
            scale = scale.reshape(ours.shape) if scale.size > 1 else np.full(ours.shape, scale.reshape(()))
            assert_same(ours, scale, f"{i} {proj}")
    assert params["embed"].dtype == params["lm_head"].dtype == params["final_norm"]["scale"].dtype == jax.numpy.bfloat16

    # load_params gives the same tree as numpy arrays.
    _, numpy_params = load_params(path, "bfloat16")
    assert _leaves(numpy_params).keys() == _leaves(params).keys()
    for p, value in _leaves(numpy_params).items():
        assert isinstance(value, np.ndarray), p
        assert_same(value, _leaves(params)[p], str(p))


def test_channel_checkpoint_is_what_quantizing_at_load_makes(dirs):
    """Quantizing the plain checkpoint at load (`quantization="fp8"`) puts the same bytes where
    the per-channel checkpoint's reshape puts them (the layouts agree), with scales equal to a
    float32 rounding (amax / 448 computed by torch and by XLA)."""
    _, at_load = load_model(dirs["plain"][0], "float32", quantization="fp8", scan_layers=True)
    _, stored = load_model(dirs["channel"][0], "float32", scan_layers=True)
    at_load, stored = _leaves(state(at_load)), _leaves(state(stored))
    assert at_load.keys() == stored.keys()
    for p, value in stored.items():
        if np.asarray(value).dtype == FP8:
            np.testing.assert_array_equal(bits(value), bits(at_load[p]), err_msg=str(p))
        else:
            np.testing.assert_allclose(np.asarray(value), np.asarray(at_load[p]), rtol=2e-7, atol=0, err_msg=str(p))


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_logits_match_transformers_on_the_dequantized_weights(dirs, strategy):
    """(b) Prompt logits against transformers running the dequantized float32 weights (fp8 *
    scale). The fp8 model also quantizes every projection's input per token to fp8 (3 mantissa
    bits: up to 6% per element), so:

    - with that activation rounding emulated in transformers (a pre-hook on each projection),
      the logits agree far better than without it: mean error under a quarter of the
      unemulated one, and max under 0.25. Both must round the same activations to the same fp8
      values, and a last-bit difference in float32 (summation order, fused multiply-adds, the
      CPU, LLVM's optimisation level) can carry one across a rounding boundary; through
      attention that moves every later position a little (measured at the tests' LLVM -O0:
      per-channel scales agree to 1.0e-4 everywhere, mean 1.2e-6; the per-tensor checkpoint's
      positions after the 6th move by up to 0.19, mean 0.016, against 0.105 unemulated). A wrong
      scale, axis or activation rounding leaves the unemulated error or worse;
    - without it, the error is the activation rounding alone: about the size of what
      quantizing the plain checkpoint at load costs against the plain model (weights and
      activations rounded; measured max 1.39, mean 0.16 for logits of std 1.2, against 0.85 and
      0.11 here); bounded by 1.25x that, and the greedy tokens mostly agree.
    """
    path, dequantized = dirs[strategy]
    _, model = load_model(path, "float32")
    ours = PagedGenerator(model).prompt_logits(PROMPT)
    reference = hf_logits(dequantized)

    handles = with_fp8_activations(dequantized)
    try:
        emulated = hf_logits(dequantized)
    finally:
        for handle in handles:
            handle.remove()
    emulation_error = np.abs(ours - emulated)  # [positions, vocab]
    error = np.abs(ours - reference)
    assert emulation_error.mean() < 0.25 * error.mean() and emulation_error.max() < 0.25, emulation_error.max(-1)

    plain_path, plain = dirs["plain"]
    _, at_load = load_model(plain_path, "float32", quantization="fp8")
    at_load_error = np.abs(PagedGenerator(at_load).prompt_logits(PROMPT) - hf_logits(plain))
    assert error.max() <= 1.25 * at_load_error.max() and error.mean() <= 1.25 * at_load_error.mean()
    assert error.mean() < 0.15 * reference.std()
    assert (ours.argmax(-1) == reference.argmax(-1)).mean() >= 0.75


def test_engine_starts_as_fp8_and_refuses_int8(dirs):
    """(c) An engine over the FP8 checkpoint, no quantization argument: fp8 weights, and the
    greedy tokens of the model `load_model` builds. int8 for it is refused, naming both."""
    from jaxpaged import LLM

    path = str(dirs["channel"][0])
    llm = LLM(path, dtype="float32", max_model_len=32, max_num_seqs=1, max_num_batched_tokens=16)  # few programs
    assert llm.llm_engine.config.load.quantization == "fp8"
    leaves = jax.tree_util.tree_flatten_with_path(llm.llm_engine.runner.params)[0]
    dtypes = {param_path(p)[-1]: leaf.dtype for p, leaf in leaves}
    assert dtypes["q_proj_quant"] == dtypes["down_proj_quant"] == FP8 and dtypes["o_proj_scale"] == np.float32
    assert "q_proj" not in dtypes and dtypes["embed"] == np.float32
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    [out] = llm.generate([{"prompt_token_ids": PROMPT[:12]}], greedy, use_tqdm=False)
    _, model = load_model(path, "float32")
    assert out.outputs[0].token_ids == PagedGenerator(model).generate([PROMPT[:12]], 10)[0]
    assert EngineConfig.resolve(EngineArgs(model=path, quantization="fp8")).load.quantization == "fp8"  # the same: fine

    with pytest.raises(EngineArgsError, match=r"quantization='int8'.*'fp8'") as exc:
        EngineConfig.resolve(EngineArgs(model=path, quantization="int8"))
    assert exc.value.field == "quantization"
    with pytest.raises(ValueError, match=r"'int8'.*'fp8'"):
        load_model(path, "float32", quantization="int8")


def test_missing_scale_fails_from_headers(dirs, tmp_path, monkeypatch):
    """(d) A checkpoint lacking a weight_scale, holding a wrongly shaped scale, a bf16 weight
    where fp8 belongs, a misshaped input_scale or a stray quantization tensor fails naming it,
    before any tensor data is read."""
    path = copy_checkpoint(dirs["tensor"][0], tmp_path / "ckpt")

    def no_data(*args, **kwargs):
        raise AssertionError("tensor data read before the headers were checked")

    cases = [
        (
            lambda t: t.pop("model.layers.1.mlp.down_proj.weight_scale"),
            r"missing keys: model\.layers\.1\.mlp\.down_proj\.weight_scale",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.k_proj.weight_scale": torch.ones(32, 2)}),
            r"model\.layers\.0\.self_attn\.k_proj\.weight_scale.*\[32, 2\].*\[32, 1\]",
        ),
        (
            lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(128, 64, dtype=torch.bfloat16)}),
            r"model\.layers\.0\.mlp\.up_proj\.weight.*stored as BF16.*F8_E4M3",
        ),
        (
            lambda t: t.update({"model.layers.1.self_attn.o_proj.input_scale": torch.ones(2)}),
            r"model\.layers\.1\.self_attn\.o_proj\.input_scale.*\[2\]",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.q_proj.weight_zero_point": torch.zeros(128, 1)}),
            r"unexpected keys: model\.layers\.0\.self_attn\.q_proj\.weight_zero_point",
        ),
    ]
    original = load_file(str(path / "model.safetensors"))
    for edit, message in cases:
        tensors = dict(original)
        edit(tensors)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        with monkeypatch.context() as m:
            m.setattr(SafetensorsCheckpoint, "iter_tensors", no_data)
            with pytest.raises(ValueError, match=message):
                load_params(path)
            with pytest.raises(ValueError, match=message):
                load_model(path)


def test_config_and_weights_must_agree(dirs, tmp_path):
    """Plain weights under a compressed-tensors config.json are refused naming the missing
    scales; fp8 weights under a config.json without quantization_config naming the scales they
    hold and the missing config, and the fp8 type where a plain one belongs."""
    plain = copy_checkpoint(dirs["plain"][0], tmp_path / "plain" / "ckpt")
    config = json.loads((plain / "config.json").read_text())
    fp8_config = json.loads((dirs["channel"][0] / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "quantization_config": fp8_config["quantization_config"]}))
    with pytest.raises(ValueError, match=r"missing keys: model\.layers\.0\.mlp\.down_proj\.weight_scale"):
        load_params(plain)

    fp8 = copy_checkpoint(dirs["channel"][0], tmp_path / "fp8" / "ckpt")
    (fp8 / "config.json").write_text(json.dumps({k: v for k, v in fp8_config.items() if k != "quantization_config"}))
    with pytest.raises(
        ValueError,
        match=r"unexpected keys: model\.layers\.0\.mlp\.down_proj\.weight_scale.*"
        r"no quantization_config",
    ):
        load_params(fp8)
    edit_tensors(fp8, lambda t: [t.pop(name) for name in list(t) if name.endswith("_scale")], framework="torch")
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj\.weight.*stored as F8_E4M3, expected F32"):
        load_params(fp8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_convert_keeps_fp8(dirs, tmp_path, dtype):
    """(e) jaxpaged-convert writes the fp8 weights as float8_e4m3fn and the scales as float32
    (the dtype option applies to the plain tensors), keeps the quantization_config, and the
    converted directory loads as the same model."""
    src = dirs["tensor"][0]
    out = tmp_path / "converted"
    assert convert_main(["--hf-dir", str(src), "--out", str(out), "--dtype", dtype, "--no-progress"]) == 0
    marker = json.loads((out / "jaxpaged_format.json").read_text())
    assert marker["quantization"] == "fp8" and marker["dtype"] == dtype
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"

    _, expected = load_params(src, dtype)
    _, converted = load_params(out)  # "auto": the converted dtype
    expected, converted = _leaves(expected), _leaves(converted)
    assert expected.keys() == converted.keys()
    for p, value in converted.items():
        assert_same(value, expected[p], str(p))
        kind = FP8 if p[-1].endswith("_quant") else np.float32 if p[-1].endswith("_scale") else np.dtype(dtype)
        assert value.dtype == kind, p

    _, from_hf = load_model(src, dtype, scan_layers=True)
    _, from_converted = load_model(out, scan_layers=True)
    a, b = _leaves(state(from_hf)), _leaves(state(from_converted))
    assert a.keys() == b.keys()
    for p in a:
        assert_same(a[p], b[p], str(p))

    # The marker and config.json must agree on the quantization.
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "quantization_config"}))
    with pytest.raises(ValueError, match=r"quantization='fp8'.*config\.json says None"):
        load_params(out)


def test_other_quantization_methods_are_refused(dirs, tmp_path):
    """(f) A quant_method jaxpaged does not read (bitsandbytes here; AWQ, GPTQ and
    compressed-tensors are read) is refused when the configuration is resolved, naming the field
    and its value."""
    path = copy_checkpoint(dirs["channel"][0], tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        EngineArgsError, match=r"quantization_config\.quant_method='bitsandbytes' is not supported"
    ) as exc:
        EngineConfig.resolve(EngineArgs(model=str(path)))
    assert exc.value.field == "model"
    with pytest.raises(CheckpointQuantizationError, match="quant_method='bitsandbytes'"):
        load_params(path)
    with pytest.raises(CheckpointQuantizationError, match="quant_method='bitsandbytes'"):
        convert_checkpoint(path, tmp_path / "out", progress=False)

    config["quantization_config"] = json.loads((dirs["channel"][0] / "config.json").read_text())["quantization_config"]
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int")
    (path / "config.json").write_text(json.dumps(config))  # 4-bit integer weights, fp8 activations
    with pytest.raises(EngineArgsError, match=r"config_groups\.group_0\.input_activations=.*quantized activations"):
        EngineConfig.resolve(EngineArgs(model=str(path)))


def test_fp8_checkpoint_loads_into_its_shards(tmp_path):
    """Under tensor parallelism (4 devices, 2 kv heads repeated), from safetensors and from a
    converted directory: each fp8 weight and scale arrives split as the table says, holding the
    single-device values in the mesh layout."""
    hf_dir, converted = str(tmp_path / "hf"), str(tmp_path / "converted")
    save_fp8_checkpoint("llama_tp", hf_dir)
    convert_checkpoint(hf_dir, converted, dtype="float32", progress=False)
    config = read_model_config(hf_dir)
    _, single = load_model(hf_dir, "float32", scan_layers=True)
    parallel = TensorParallel.create(config, 4)
    assert parallel.layout.kv_replicas == 2
    check_loaded_into_shards((hf_dir, converted), parallel, single, assert_same)


def _leaves(tree, prefix=()):
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_leaves(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out
