"""The parameter tables (`jaxpaged.config.architectures`) are the one declaration of every parameter: the model
built from them, the checkpoint key map, the sharding of every placed array and `jaxpaged plan`'s
bytes per device all agree, for every supported architecture, weight quantization and
tensor-parallel size (8 CPU devices; more devices than kv heads repeats them, and a vocabulary of
500 stays whole over 8).
"""

import json
import math

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxpaged.checkpoint.hf_keys import by_name, hf_key_specs
from jaxpaged.config.architectures import ARCHITECTURES, BY_HF_NAME
from jaxpaged.config.hf_config import model_config_from_hf
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.tables import state_params, state_shapes
from jaxpaged.engine.setup import build_model
from jaxpaged.engine_args import EngineArgs
from jaxpaged.engine_config import EngineConfig
from jaxpaged.model import LayerArrays, Llama
from jaxpaged.parallel.mesh import TensorParallel, bytes_per_device, make_mesh, param_path
from jaxpaged.planning.plan import weight_bytes_per_gpu

BASE = dict(
    vocab_size=500,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
# One config.json per table variant: every optional parameter of every table is present in one.
VARIANTS = {
    "llama": dict(architectures=["LlamaForCausalLM"]),
    "llama_attention_bias_tied": dict(
        architectures=["LlamaForCausalLM"], attention_bias=True, tie_word_embeddings=True
    ),
    "mistral": dict(architectures=["MistralForCausalLM"], sliding_window=None),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"]),
    "phi3": dict(architectures=["Phi3ForCausalLM"], partial_rotary_factor=0.5),  # fused qkv and gate/up tensors
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], sliding_window=16),  # norms after attention and MLP
    # its tensors under language_model., the sizes in text_config
    "gemma3_vlm": dict(architectures=["Gemma3ForConditionalGeneration"], text_config={**BASE, "sliding_window": 16}),
    "mixtral": dict(architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        architectures=["Qwen2MoeForCausalLM"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32
    ),
}
QUANTIZATIONS = (None, "fp8", "int8")
SIZES = (1, 2, 4, 8)


def config_of(variant: str) -> ModelConfig:
    return model_config_from_hf({**BASE, **VARIANTS[variant]})


def test_every_architecture_and_every_optional_parameter_is_covered():
    assert {config_of(v).architecture for v in VARIANTS} == {a.name for a in BY_HF_NAME.values()} == set(ARCHITECTURES)
    covered = {spec.path for v in VARIANTS for spec in state_params_specs(config_of(v))}
    declared = {spec.path for arch in ARCHITECTURES.values() for spec in arch.params}
    assert covered == declared


def state_params_specs(config):
    return {p.spec for p in state_params(config).values()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpoint_keys_target_exactly_the_model_state(variant):
    """Plain and pre-quantized (fp8) checkpoints: one key per layer of every per-layer parameter,
    each targeting a state array of the shape it becomes."""
    config = config_of(variant)
    for prequantized in (None, "fp8"):
        shapes = state_shapes(config, prequantized)
        specs = hf_key_specs(config, prequantized)
        assert {s.target for s in specs} == set(shapes)
        arrays = state_params(config, prequantized is not None).values()
        experts = config.moe.num_experts if config.moe else 1
        per_layer = sum(experts if p.spec.per_expert else 1 for p in arrays if p.spec.per_layer)
        assert len(specs) == sum(not p.spec.per_layer for p in arrays) + config.num_layers * per_layer
        for s in specs:
            lead = () if s.layer is None else (config.num_layers,) if s.expert is None else (config.num_layers, experts)
            assert (*lead, *s.shape) == shapes[s.target], s
            rows = s.hf_shape[0] if s.rows is None else s.rows[1] - s.rows[0]  # a fused tensor's part
            assert rows * math.prod(s.hf_shape[1:]) == math.prod(s.shape), s
        for parts in by_name(specs).values():  # a fused tensor's parts tile its rows, in order
            if parts[0].rows is not None and not parts[0].broadcast:
                bounds = [b for p in parts for b in p.rows]
                assert bounds[0] == 0 and bounds[-1] == parts[0].hf_shape[0] and bounds == sorted(bounds), parts


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_model_sharding_and_plan_agree_for_every_size(variant, quantization):
    """The model's state (built from the table, layers stacked) has the table's paths and shapes;
    each array's sharding splits the axes the table names; and its bytes on the fullest device,
    stacked or as per-layer arrays, are `jaxpaged plan`'s."""
    config = config_of(variant)
    for n in SIZES:
        parallel = TensorParallel.create(config, n)
        mesh_config = parallel.layout.mesh_config
        model = nnx.eval_shape(
            lambda: Llama(
                mesh_config,
                jnp.bfloat16,
                rngs=nnx.Rngs(0),
                parallel=parallel,
                scan_layers=True,
                quantization=quantization,
            )
        )
        leaves = {param_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]}
        assert {p: x.shape for p, x in leaves.items()} == state_shapes(mesh_config, quantization), (variant, n)
        per_device = 0
        for path, x in leaves.items():
            sharding = parallel.param_sharding(path)
            shard = sharding.shard_shape(x.shape)
            axes = state_params(config, quantization is not None)[path].axes
            for axis, size, part in zip(axes, x.shape, shard):  # split exactly where the rules split the axis
                assert (part < size) == (parallel.layout.mesh_axes((axis,)) != (None,)), (variant, n, path, axis)
            if path[0] == "layers":  # one layer's array on one layer's sharding: the same shard
                assert parallel.layer_sharding(path).shard_shape(x.shape[1:]) == shard[1:]
            per_device += math.prod(shard) * x.dtype.itemsize
        assert per_device == weight_bytes_per_gpu(config, "bfloat16", quantization, n), (variant, n)


@pytest.mark.parametrize(
    ("variant", "quantization", "n"),
    [
        ("qwen3", "fp8", 4),
        ("llama_attention_bias_tied", "int8", 8),
        ("qwen2", None, 8),
        ("mistral", "fp8", 2),
        ("qwen2_moe", "fp8", 4),
    ],
)
def test_placed_arrays_are_where_the_table_says(tmp_path, variant, quantization, n):
    """The engine's own start-up (dummy weights) places every array, split into per-layer arrays,
    with the table's sharding, and each device holds `jaxpaged plan`'s bytes."""
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **VARIANTS[variant], "torch_dtype": "float32"}))
    args = EngineArgs(
        model=str(tmp_path),
        load_format="dummy",
        tensor_parallel_size=n,
        quantization=quantization,
        skip_tokenizer_init=True,
        max_model_len=64,
    )
    config = EngineConfig.resolve(args)
    parallel = TensorParallel(config.layout, make_mesh(n))
    model = build_model(config, parallel)
    state = nnx.state(model)
    checked = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, LayerArrays))[0]:
        name = param_path(path)
        arrays = leaf.arrays if isinstance(leaf, LayerArrays) else (leaf,)
        expected = parallel.layer_sharding(name) if isinstance(leaf, LayerArrays) else parallel.param_sharding(name)
        for array in arrays:
            assert array.sharding.is_equivalent_to(expected, array.ndim), name
        checked += 1
    assert checked == len(state_params(config.model, quantization is not None))
    on_devices = bytes_per_device(state)
    assert len(on_devices) == n
    assert max(on_devices.values()) == weight_bytes_per_gpu(config.model, "float32", quantization, n)


def test_an_architecture_is_one_module_of_the_package():
    """Every module of `jaxpaged.config.architectures` is an architecture, found without a list to
    edit, and config.json's class names are read from them alone (no other registry)."""
    import pkgutil

    from jaxpaged.config import architectures, model_config

    modules = {m.name for m in pkgutil.iter_modules(architectures.__path__)}
    assert modules == set(ARCHITECTURES) and all(ARCHITECTURES[m].name == m for m in modules)
    assert not any(name.endswith("ForCausalLM") for name in vars(model_config) if isinstance(name, str))
    source = open(model_config.__file__).read()
    assert all(hf not in source for hf in BY_HF_NAME), "an HF class name is declared outside its architecture"
