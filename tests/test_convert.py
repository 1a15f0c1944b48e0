"""HF safetensors -> params: the key map, the converter, the CLI and every rejection."""

import fnmatch
import json
import os
import subprocess
import sys
import tomllib

import jax
import ml_dtypes
import numpy as np
import pytest
from checkpoint_edits import copy_checkpoint, edit_tensors
from flax import nnx
from safetensors.numpy import load_file, save_file
from tiny_models import save_hf_model

from jaxpaged.checkpoint.convert import convert_checkpoint
from jaxpaged.checkpoint.hf_keys import hf_key_specs, param_shapes
from jaxpaged.checkpoint.loader import load_model, load_params
from jaxpaged.entrypoints.convert_cli import main
from jaxpaged.model.llama import Llama

VARIANT_CASES = [
    ("llama_mha", None),
    ("llama_tied", None),
    ("qwen2_bias", None),
    ("llama_gqa8", None),
    ("mistral", "50KB"),  # sharded: model.safetensors.index.json + several shards
]


def leaves(tree, prefix=()):
    """{path: leaf} of a nested dict."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(leaves(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def hf_state(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A small untied Llama checkpoint, shared read-only; rejection tests copy it."""
    path = tmp_path_factory.mktemp("hf") / "llama"
    save_hf_model("llama_gqa4", str(path))
    return path


@pytest.mark.parametrize("variant,shard_size", VARIANT_CASES)
def test_hf_and_converted_params_match_torch(variant, shard_size, tmp_path):
    torch_model = save_hf_model(variant, str(tmp_path / "hf"), max_shard_size=shard_size)
    if shard_size:
        assert os.path.exists(tmp_path / "hf" / "model.safetensors.index.json")
    convert_checkpoint(tmp_path / "hf", tmp_path / "out", dtype="float32", progress=False)
    config, ours = load_params(tmp_path / "hf", "float32")
    config2, converted = load_params(tmp_path / "out", "float32")
    assert config == config2

    # HF dir and converted dir agree exactly, leaf for leaf, with the model's own tree.
    ours_flat, conv_flat = leaves(ours), leaves(converted)
    assert ours_flat.keys() == conv_flat.keys()
    for path, value in ours_flat.items():
        assert value.dtype == np.float32 and conv_flat[path].dtype == np.float32, path
        np.testing.assert_array_equal(value, conv_flat[path], err_msg=str(path))
    abstract = nnx.eval_shape(lambda: Llama(config, np.float32, rngs=nnx.Rngs(0), scan_layers=True))
    model_shapes = {p: v.shape for p, v in leaves(nnx.to_pure_dict(nnx.state(abstract))).items()}
    assert {p: v.shape for p, v in ours_flat.items()} == model_shapes

    # Against torch, by the documented transforms written out by hand.
    hf = hf_state(torch_model)
    d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    eq = np.testing.assert_array_equal
    eq(ours["embed"], hf["model.embed_tokens.weight"])
    eq(ours["final_norm"]["scale"], hf["model.norm.weight"])
    layers = ours["layers"]  # stacked: row i is layer i
    for i in range(config.num_layers):
        attn, hf_attn = {name: p[i] for name, p in layers["attn"].items()}, f"model.layers.{i}.self_attn."
        eq(attn["q_proj"].reshape(d, n * h).T, hf[hf_attn + "q_proj.weight"])
        eq(attn["k_proj"].reshape(d, k * h).T, hf[hf_attn + "k_proj.weight"])
        eq(attn["v_proj"].reshape(d, k * h).T, hf[hf_attn + "v_proj.weight"])
        eq(attn["o_proj"].reshape(n * h, d).T, hf[hf_attn + "o_proj.weight"])
        eq(layers["mlp"]["gate_proj"][i].T, hf[f"model.layers.{i}.mlp.gate_proj.weight"])
        eq(layers["mlp"]["down_proj"][i].T, hf[f"model.layers.{i}.mlp.down_proj.weight"])
        eq(layers["input_norm"]["scale"][i], hf[f"model.layers.{i}.input_layernorm.weight"])
        if config.qkv_bias:
            eq(attn["q_bias"].reshape(n * h), hf[hf_attn + "q_proj.bias"])
            eq(attn["k_bias"].reshape(k * h), hf[hf_attn + "k_proj.bias"])
            eq(attn["v_bias"].reshape(k * h), hf[hf_attn + "v_proj.bias"])
        else:
            assert "q_bias" not in attn
    if config.tie_word_embeddings:
        assert "lm_head" not in ours
    else:
        eq(ours["lm_head"].T, hf["lm_head.weight"])
    assert len(param_shapes(config)) == len(ours_flat)
    assert len(hf_key_specs(config)) == len(ours_flat) + (config.num_layers - 1) * len(leaves(layers))


def test_cli_bfloat16_end_to_end(llama_dir, tmp_path, capsys):
    hf_dir = copy_checkpoint(llama_dir, tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (hf_dir / name).write_text("{}")
    out = tmp_path / "out"
    assert main(["--hf-dir", str(hf_dir), "--out", str(out), "--dtype", "bfloat16", "--no-progress"]) == 0
    for name in ("config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (out / name).is_file(), name
    marker = json.loads((out / "jaxpaged_format.json").read_text())
    assert marker["dtype"] == "bfloat16" and marker["format_version"] == 2  # 2: layers stacked
    assert marker["quantization"] is None  # plain weights (see test_fp8_checkpoint.py for FP8)

    _, params = load_params(out)  # "auto": the converted dtype
    _, reference = load_params(hf_dir, "float32")
    for path, value in leaves(params).items():
        assert value.dtype == ml_dtypes.bfloat16, path
        np.testing.assert_array_equal(value, leaves(reference)[path].astype(ml_dtypes.bfloat16))
    _, upcast = load_params(out, "float32")
    assert all(v.dtype == np.float32 for v in leaves(upcast).values())
    # A marker written before the quantization field means plain weights.
    (out / "jaxpaged_format.json").write_text(json.dumps({k: v for k, v in marker.items() if k != "quantization"}))
    assert leaves(load_params(out)[1]).keys() == leaves(params).keys()

    # An existing checkpoint is refused without --overwrite, replaced with it.
    with pytest.raises(SystemExit) as exc:
        main(["--hf-dir", str(hf_dir), "--out", str(out), "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "jaxpaged-convert: error:" in err and "--overwrite" in err and "Traceback" not in err
    assert main(["--hf-dir", str(hf_dir), "--out", str(out), "--dtype", "float32", "--overwrite", "--no-progress"]) == 0
    _, params = load_params(out)
    assert leaves(params)[("embed",)].dtype == np.float32


def test_cli_reports_bad_checkpoint_in_one_line(llama_dir, tmp_path, capsys):
    hf_dir = copy_checkpoint(llama_dir, tmp_path / "hf")
    edit_tensors(hf_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(SystemExit) as exc:
        main(["--hf-dir", str(hf_dir), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("jaxpaged-convert: error:") and "model.layers.1.mlp.up_proj.weight" in err
    assert not (tmp_path / "out" / "jaxpaged_format.json").exists()

    with pytest.raises(SystemExit) as exc:
        main(["--hf-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out2")])
    assert exc.value.code == 2 and "config.json" in capsys.readouterr().err


def test_missing_key_is_named(llama_dir, tmp_path):
    hf_dir = copy_checkpoint(llama_dir, tmp_path / "hf")
    edit_tensors(hf_dir, lambda t: (t.pop("model.layers.1.mlp.up_proj.weight"), t.pop("model.norm.weight")))
    with pytest.raises(ValueError, match="missing keys: model.layers.1.mlp.up_proj.weight, model.norm.weight"):
        load_params(hf_dir)


def test_unexpected_key_is_named(llama_dir, tmp_path):
    hf_dir = copy_checkpoint(llama_dir, tmp_path / "hf")
    edit_tensors(hf_dir, lambda t: t.update({"model.layers.0.self_attn.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected keys: model\.layers\.0\.self_attn\.extra\.weight"):
        load_params(hf_dir)


def test_wrong_shape_is_named(llama_dir, tmp_path):
    hf_dir = copy_checkpoint(llama_dir, tmp_path / "hf")
    name = "model.layers.0.self_attn.k_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-1]

    edit_tensors(hf_dir, shrink)
    with pytest.raises(ValueError, match=rf"{name}.*\[31, 64\].*\[32, 64\]"):
        load_params(hf_dir)


def test_duplicate_key_across_shards_is_named(llama_dir, tmp_path):
    hf_dir = copy_checkpoint(llama_dir, tmp_path / "hf")
    tensors = load_file(str(hf_dir / "model.safetensors"))
    os.remove(hf_dir / "model.safetensors")
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    # model.norm.weight is in the second shard; put a copy in the first one too.
    save_file({n: tensors[n] for n in first + ["model.norm.weight"]}, str(hf_dir / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in second}, str(hf_dir / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in second})
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(ValueError, match=r"duplicate tensors.*model\.norm\.weight"):
        load_params(hf_dir)


def test_unsupported_dtype_is_named(llama_dir):
    with pytest.raises(ValueError, match="int8"):
        load_params(llama_dir, "int8")
    with pytest.raises(ValueError, match="float64"):
        load_params(llama_dir, np.float64)


def test_unsupported_architecture_is_named(llama_dir, tmp_path):
    hf_dir = copy_checkpoint(llama_dir, tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architectures"):
        load_params(hf_dir)
    with pytest.raises(ValueError, match="architectures"):
        convert_checkpoint(hf_dir, tmp_path / "out")


def test_tied_lm_head_copy_and_inv_freq_are_dropped(tmp_path):
    save_hf_model("llama_tied", str(tmp_path / "hf"))
    _, expected = load_params(tmp_path / "hf")

    def add(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    edit_tensors(tmp_path / "hf", add)
    _, params = load_params(tmp_path / "hf")
    assert leaves(params).keys() == leaves(expected).keys()

    edit_tensors(tmp_path / "hf", lambda t: t.update({"lm_head.weight": np.zeros((3, 64), np.float32)}))
    with pytest.raises(ValueError, match=r"lm_head\.weight.*\[3, 64\]"):
        load_params(tmp_path / "hf")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_model_builds_llama_with_checkpoint_shapes(llama_dir, dtype):
    config, model = load_model(llama_dir, dtype, scan_layers=True)
    assert isinstance(model, Llama)
    state = leaves(nnx.to_pure_dict(nnx.state(model)))
    expected = param_shapes(config)
    assert {p: v.shape for p, v in state.items()} == expected
    for path, value in state.items():
        assert isinstance(value, jax.Array) and value.dtype == np.dtype(dtype), path
    _, params = load_params(llama_dir, dtype)
    np.testing.assert_array_equal(np.asarray(state[("layers", "attn", "o_proj")]), params["layers"]["attn"]["o_proj"])


def test_converted_dir_checked_against_its_config(llama_dir, tmp_path):
    out = tmp_path / "out"
    convert_checkpoint(llama_dir, out, dtype="float32", progress=False)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    # the decoder layers are stacked: a checkpoint of 2 layers has 2 rows where the config expects 1
    with pytest.raises(ValueError, match=r"tensor 'layers\.[a-z_.]+' has shape \[2, [0-9, ]*\], expected \[1, "):
        load_params(out)
    (out / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(ValueError, match=r"layers\.mlp\.down_proj.*\[2, 128, 64\].*\[2, 64, 64\]"):
        load_params(out)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_installing_adds_no_top_level_module_but_jaxpaged_and_its_kernels():
    """`pip install jaxpaged` puts `jaxpaged` and `pallas_kernels` into site-packages, no module
    named `convert` (the converter is `jaxpaged.checkpoint.convert`; `convert/` in a checkout is
    `python convert`, the same command line as `jaxpaged-convert`)."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    include = setuptools["packages"]["find"]["include"]
    packages = {name for name in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, name, "__init__.py"))}
    assert {p for p in packages if any(fnmatch.fnmatch(p, pattern) for pattern in include)} == {
        "jaxpaged",
        "pallas_kernels",
    }
    proc = subprocess.run([sys.executable, "convert", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: jaxpaged-convert" in proc.stdout and "--hf-dir" in proc.stdout, proc.stderr
