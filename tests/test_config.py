"""model_config_from_hf reads every supported option and names whatever it refuses."""

import numpy as np
import pytest
import torch
import transformers

from jaxpaged.config.hf_config import model_config_from_hf
from jaxpaged.config.model_config import kv_bytes_per_token
from jaxpaged.model.rope import inverse_frequencies

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}


def test_llama_31_8b_config():
    config = model_config_from_hf(LLAMA_31_8B)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (32, 8, 128)
    assert config.rope.rope_type == "llama3" and config.rope.theta == 500000.0
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert kv_bytes_per_token(config, 2) == 131072
    assert kv_bytes_per_token(config, 2) * 4096 == 512 * 2**20


def test_qwen2_has_qkv_bias_and_mistral_head_dim():
    qwen = model_config_from_hf({**LLAMA_31_8B, "architectures": ["Qwen2ForCausalLM"], "rope_scaling": None})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.architecture == "qwen2"
    mistral = model_config_from_hf(
        {
            **LLAMA_31_8B,
            "architectures": ["MistralForCausalLM"],
            "head_dim": 96,
            "rope_scaling": None,
            "sliding_window": None,
        }
    )
    assert mistral.head_dim == 96 and mistral.sliding_window is None


def test_llama_attention_bias():
    config = model_config_from_hf({**LLAMA_31_8B, "attention_bias": True})
    assert config.qkv_bias and config.o_bias


@pytest.mark.parametrize(
    "change,field",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ],
)
def test_unsupported_fields_are_named(change, field):
    with pytest.raises(ValueError, match=field):
        model_config_from_hf({**LLAMA_31_8B, **change})


def test_sliding_windows_per_layer_and_any_context():
    """A window applies to the layers config.json says (Mistral: all; Qwen2: from
    max_window_layers, only with use_sliding_window) and no longer caps the context."""
    mistral = model_config_from_hf(
        {**LLAMA_31_8B, "architectures": ["MistralForCausalLM"], "rope_scaling": None, "sliding_window": 4096}
    )
    assert mistral.max_context_len == 131072 and mistral.check_max_model_len(32768) == 32768
    assert {mistral.window_of(i) for i in range(32)} == {4096} and mistral.layers_alike
    qwen = dict(LLAMA_31_8B, architectures=["Qwen2ForCausalLM"], sliding_window=4096, num_hidden_layers=4)
    assert model_config_from_hf({**qwen, "use_sliding_window": False}).sliding_window is None
    upper = model_config_from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 2})
    assert [upper.window_of(i) for i in range(4)] == [None, None, 4096, 4096] and not upper.layers_alike
    with pytest.raises(ValueError, match="layer_types"):
        model_config_from_hf({**qwen, "use_sliding_window": True, "layer_types": ["sliding_attention"] * 3})


GEMMA3_1B_V4 = {  # gemma-3-1b's config.json as transformers 4.50 wrote it (sizes cut down)
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "vocab_size": 512,
    "rope_theta": 1000000,
    "rope_local_base_freq": 10000,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
}


def test_gemma3_configs_of_transformers_4_and_5_read_the_same():
    """Local layers (5 of 6) slide with their own base; the global ones scale theirs; the fields a
    4.x config.json leaves out take Gemma3TextConfig's defaults, not Llama's."""
    old = model_config_from_hf(GEMMA3_1B_V4)
    assert [old.window_of(i) is None for i in range(12)] == [i % 6 == 5 for i in range(12)]
    assert old.rope.theta == 1e6 and old.rope.rope_type == "linear" and old.rope.factor == 8.0
    assert old.local_rope.theta == 1e4 and old.local_rope.rope_type == "default"
    assert old.rope_of(0) == old.local_rope and old.rope_of(5) == old.rope
    assert old.head_dim == 256 and old.softmax_scale == 256**-0.5 and old.hidden_act == "gelu_pytorch_tanh"
    assert old.tie_word_embeddings and old.rms_norm_eps == 1e-6 and old.max_position_embeddings == 131072
    new = {k: v for k, v in GEMMA3_1B_V4.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    new |= {
        "layer_types": [("full" if i % 6 == 5 else "sliding") + "_attention" for i in range(12)],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }
    assert model_config_from_hf(new) == old
    for field, value in (("final_logit_softcapping", 30.0), ("attn_logit_softcapping", 50.0), ("hidden_act", "relu")):
        with pytest.raises(ValueError, match=field):
            model_config_from_hf({**GEMMA3_1B_V4, field: value, "hidden_activation": None})


def test_context_beyond_position_limit_is_refused():
    with pytest.raises(ValueError, match="max_position_embeddings=131072"):
        model_config_from_hf(LLAMA_31_8B).check_max_model_len(200000)


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
        {**LLAMA_31_8B["rope_scaling"], "rope_theta": 500000.0},
    ],
)
def test_inverse_frequencies_match_transformers(rope_parameters):
    hf_config = transformers.LlamaConfig(
        hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072, rope_parameters=rope_parameters
    )
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf_config)
    ours_config = model_config_from_hf({**hf_config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    ours = inverse_frequencies(ours_config.rope, 128)
    np.testing.assert_allclose(ours, rotary.inv_freq.to(torch.float32).numpy(), rtol=1e-6)


@pytest.mark.parametrize("long", [False, True])
def test_longrope_frequencies_and_attention_factor_match_transformers(long):
    """Phi-4-mini's shapes: 3/4 of 128 features rotated, 4K pre-training context grown to 128K."""
    factors = dict(short_factor=[1.0 + i / 50 for i in range(48)], long_factor=[1.0 + i for i in range(48)])
    hf_config = transformers.Phi3Config(
        hidden_size=3072,
        num_attention_heads=24,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        partial_rotary_factor=0.75,
        rope_scaling=dict(type="longrope", **factors),
        pad_token_id=0,
    )
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"]
    inv_freq, attention = init(hf_config, None, seq_len=8192 if long else None)
    ours = model_config_from_hf({**hf_config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    ours = ours.for_max_model_len(8192 if long else 4096)
    assert ours.rope.use_long_factor == long and ours.rope.rotary_dim(128) == 96
    np.testing.assert_allclose(inverse_frequencies(ours.rope, 128), inv_freq.numpy(), rtol=1e-6)
    assert ours.rope.attention_factor == pytest.approx(attention, rel=1e-12)


def test_longrope_and_partial_rotary_errors_name_the_field():
    phi = {**LLAMA_31_8B, "architectures": ["Phi3ForCausalLM"], "original_max_position_embeddings": 4096}
    longrope = {"type": "longrope", "short_factor": [1.0] * 64, "long_factor": [1.0] * 63}
    with pytest.raises(ValueError, match=r"rope_scaling.long_factor must list 64 numbers"):
        model_config_from_hf({**phi, "rope_scaling": longrope})
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.2 rotates 25 of head_dim=128"):
        model_config_from_hf({**phi, "rope_scaling": None, "partial_rotary_factor": 0.2})


def test_a_gemma3_multimodal_config_reads_its_text_config_with_gemma3s_defaults():
    """google/gemma-3-4b-it's config.json (transformers 4.50): its text_config names only widths,
    depth, the window and the global layers' scaling; the rest are Gemma3TextConfig's defaults."""
    hf = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "eos_token_id": [1, 106],
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
    }
    config = model_config_from_hf(hf)
    assert config.architecture == "gemma3_vlm" and (config.num_heads, config.num_kv_heads, config.head_dim) == (
        8,
        4,
        256,
    )
    assert config.vocab_size == 262208 and config.eos_token_ids == (1, 106) and config.tie_word_embeddings
    assert config.rope.factor == 8.0 and config.local_rope.theta == 1e4 and config.window_of(5) is None
    assert config.window_of(0) == 1024
    with pytest.raises(ValueError, match="no 'text_config'"):
        model_config_from_hf({"architectures": ["Gemma3ForConditionalGeneration"]})


def test_the_config_modules_import_one_way():
    """model_config <- config.params.spec <- config.architectures <- hf_config, and the tables
    derived from the architectures after them: no module imports one after it (not even lazily,
    inside a function)."""
    import ast
    import pathlib

    order = ["model_config", "params.spec", "architectures", "hf_config", "params.tables", "params.quantized"]
    root = pathlib.Path(__file__).parent.parent / "jaxpaged" / "config"
    sources = {name: root / f"{name.replace('.', '/')}.py" for name in order}
    sources["architectures"] = root / "architectures" / "__init__.py"
    for i, name in enumerate(order):
        tree = ast.parse(sources[name].read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        later = {f"jaxpaged.config.{m}" for m in order[i + 1 :]}
        assert not imported & later, (name, imported & later)
