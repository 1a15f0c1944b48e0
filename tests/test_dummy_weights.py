"""Dummy weights (`load_format="dummy"`) are made a parameter and a layer at a time, with bounded
temporaries, hold `Llama`'s own initial values for every tensor-parallel size, and an engine that
cannot fit on the host is refused before anything is allocated."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged.checkpoint.dummy import dummy_params, dummy_programs
from jaxpaged.cli import main
from jaxpaged.engine import setup
from jaxpaged.engine_args import EngineArgs
from jaxpaged.engine_config import EngineConfig
from jaxpaged.model import LayerArrays, Llama
from jaxpaged.parallel.mesh import TensorParallel, make_mesh

GiB = 2**30


def resolve(model: str, **options) -> EngineConfig:
    return EngineConfig.resolve(
        EngineArgs(model=model, load_format="dummy", skip_tokenizer_init=True, max_model_len=64, **options)
    )


def test_dummy_init_temporaries_do_not_grow_with_the_layers():
    """Llama-3.1-8B's widths, compiled only: each program's temporaries stay below the values it
    makes (one layer's, or the embedding and LM head) whatever the number of layers (the whole-model
    program needed ~67 GiB of temporaries on a CPU for 32 layers)."""
    config = resolve("llama-3.1-8b")
    key = nnx.Rngs(0).params()
    temps = {}
    for layers in (2, 32):
        model = dataclasses.replace(config.model, num_layers=layers)
        programs = dummy_programs(model, jnp.bfloat16, config.load, TensorParallel.create(model, 1))
        for name in ("layer", "model") if layers == 2 else ("layer",):  # "model" has no layer in it
            memory = programs[name].lower(key, jnp.int32(0)).compile().memory_analysis()
            assert memory.temp_size_in_bytes <= memory.output_size_in_bytes, (name, layers)
            temps[name, layers] = memory.temp_size_in_bytes
    assert temps["layer", 2] == temps["layer", 32], temps
    assert temps["model", 2] < GiB / 4, temps


TINY = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=500,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    torch_dtype="float32",
)


def test_dummy_weights_are_llamas_values_for_every_split_and_layout(tmp_path):
    """The values `Llama(..., rngs=nnx.Rngs(seed))` holds (to rounding: it computes them op by
    op), at the checkpoint's shapes; the same bits on one device with per-layer arrays and on four
    devices stacked for a scan (2 kv heads repeated)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    config = resolve(str(tmp_path), seed=5)
    whole = nnx.to_pure_dict(nnx.state(Llama(config.model, jnp.float32, rngs=nnx.Rngs(5), scan_layers=False)))
    one = dummy_params(config.model, jnp.float32, config.load, TensorParallel(config.layout, make_mesh(1)))
    split = resolve(str(tmp_path), seed=5, tensor_parallel_size=4, scan_layers=True)
    four = dummy_params(split.model, jnp.float32, split.load, TensorParallel(split.layout, make_mesh(4)))
    assert one.keys() == four.keys() and len(one) == len(jax.tree.leaves(whole, is_leaf=_is_layer_arrays))
    for path, value in one.items():
        expected = whole
        for name in path:
            expected = expected[name]
        layers = value.arrays if isinstance(value, LayerArrays) else (value,)
        expected = expected.arrays if isinstance(expected, LayerArrays) else (expected,)
        stacked = np.asarray(four[path]) if isinstance(value, LayerArrays) else np.asarray(four[path])[None]
        if path[-1] in ("k_proj", "v_proj"):  # [D, K, H]: each kv head twice in the mesh layout
            stacked = stacked[:, :, ::2]
        for layer, array in enumerate(layers):
            np.testing.assert_allclose(array, expected[layer], rtol=1e-6, err_msg=str(path))
            np.testing.assert_array_equal(array, stacked[layer], err_msg=str(path))
    assert four[("layers", "mlp", "up_proj")].sharding.num_devices == 4


def _is_layer_arrays(x) -> bool:
    return isinstance(x, LayerArrays)


@pytest.mark.parametrize(
    "flags, available, message",
    [
        (
            [],
            12 * GiB,
            "--model llama-3.1-8b: needs at least 14.97 GiB of this machine's memory on the CPU (weights "
            "14.96 GiB in bfloat16, KV cache 8.00 MiB x 1 device(s)) but 12.00 GiB is available; quantize the "
            "weights (--quantization int8",
        ),
        (
            ["--kv-cache-memory-bytes", "16GiB"],
            24 * GiB,
            "needs at least 30.96 GiB of this machine's memory on the CPU (weights 14.96 GiB in bfloat16, KV "
            "cache 16.00 GiB x 1 device(s)) but 24.00 GiB is available; lower --kv-cache-memory-bytes",
        ),
    ],
)
def test_an_engine_the_host_cannot_hold_is_refused_before_anything_is_allocated(
    tmp_path, capsys, monkeypatch, flags, available, message
):
    """The README's 8B dummy example, on a host with less memory than it needs."""
    src = tmp_path / "ids.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "max_tokens": 4}) + "\n")
    monkeypatch.setattr(setup, "host_available_bytes", lambda: available)
    monkeypatch.setattr(setup, "build_model", lambda *args: pytest.fail("the model was built"))
    argv = ["generate", "--model", "llama-3.1-8b", "--load-format", "dummy", "--input", str(src), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_host_available_bytes_reads_meminfo_and_a_cgroup_limit(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 24684084 kB\nMemAvailable: 2097152 kB\n")
    assert setup.host_available_bytes(str(tmp_path / "meminfo"), str(tmp_path)) == 2 * GiB
    (tmp_path / "memory.max").write_text(f"{GiB}\n")
    (tmp_path / "memory.current").write_text(f"{GiB // 4}\n")
    assert setup.host_available_bytes(str(tmp_path / "meminfo"), str(tmp_path)) == GiB * 3 // 4
    (tmp_path / "memory.max").write_text("max\n")
    assert setup.host_available_bytes(str(tmp_path / "meminfo"), str(tmp_path)) == 2 * GiB
