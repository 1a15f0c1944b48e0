"""Gemma 3's text models (`Gemma3ForCausalLM`: gemma-3-1b, and the text-only checkpoints of the
larger ones; `gemma3_vlm.py` serves the multimodal ones' language model): Llama's network with Qwen3's q/k norms, a norm after attention and after the MLP
as well as before each, every norm scaling by `1 + w`, embeddings scaled by `sqrt(hidden_size)`,
GELU-tanh in the MLP and a softmax scale from `query_pre_attn_scalar`. Five of every six layers
attend to a sliding window with their own rotary base (`layer_types`, `rope_parameters` per
layer type or `rope_local_base_freq`: `jaxpaged.config.model_config`).

Dimension letters: D hidden, H head_dim.
"""

import dataclasses

from jaxpaged.config.architectures import Architecture
from jaxpaged.config.architectures.llama import LAYER
from jaxpaged.config.architectures.qwen3 import PARAMS as QWEN3_PARAMS
from jaxpaged.config.params.spec import EMBED, ParamSpec

# The Llama slot `post_attention_norm` is the norm before the MLP: Gemma's pre_feedforward_layernorm.
RENAMED = {("layers", "post_attention_norm", "scale"): LAYER + "pre_feedforward_layernorm.weight"}
SANDWICH = (
    ParamSpec(("layers", "attn_out_norm", "scale"), (EMBED,), LAYER + "post_attention_layernorm.weight"),
    ParamSpec(("layers", "mlp_out_norm", "scale"), (EMBED,), LAYER + "post_feedforward_layernorm.weight"),
)


def _gemma(spec: ParamSpec) -> ParamSpec:
    """A norm's scale starts at zero (it multiplies by 1 + w), and the renamed slot its name."""
    if spec.path[-1] not in ("scale", "q_norm", "k_norm"):
        return spec
    return dataclasses.replace(spec, hf_name=RENAMED.get(spec.path, spec.hf_name), init="zeros")


PARAMS = tuple(_gemma(spec) for spec in (*QWEN3_PARAMS, *SANDWICH))

# Gemma3TextConfig's defaults for what a config.json may leave out (a multimodal checkpoint's
# text_config names little more than its widths and depth).
HF_DEFAULTS = (
    ("vocab_size", 262_208),
    ("hidden_size", 2304),
    ("intermediate_size", 9216),
    ("num_hidden_layers", 26),
    ("num_attention_heads", 8),
    ("num_key_value_heads", 4),
    ("bos_token_id", 2),
    ("eos_token_id", 1),
    ("hidden_activation", "gelu_pytorch_tanh"),
    ("rms_norm_eps", 1e-6),
    ("tie_word_embeddings", True),
    ("head_dim", 256),
    ("query_pre_attn_scalar", 256),
    ("sliding_window", 4096),
    ("sliding_window_pattern", 6),
    ("rope_theta", 1_000_000.0),
    ("rope_local_base_freq", 10_000.0),
    ("max_position_embeddings", 131_072),
)

ARCHITECTURE = Architecture(
    "gemma3",
    ("Gemma3ForCausalLM",),
    PARAMS,
    hf_defaults=HF_DEFAULTS,
    unit_offset_norms=True,
    scaled_embeddings=True,
)
