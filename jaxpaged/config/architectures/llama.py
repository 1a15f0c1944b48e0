"""Llama, and the Llama family's parameters (Mistral and Qwen2 have the same): the one
declaration of each.

Dimension letters: V vocabulary, D hidden, N query heads, K kv heads, H head_dim, F MLP width.
"""

from jaxpaged.config.architectures import Architecture
from jaxpaged.config.params.spec import EMBED, HEAD_DIM, HEADS, KV_HEADS, MLP, VOCAB, ParamSpec

ATTN, LAYER = ("layers", "attn"), "model.layers.{layer}."


def linear(path, axes, hf_name, num_in=1, **kw) -> ParamSpec:
    """A projection (HF `weight[out, in]`) that weight quantization replaces."""
    return ParamSpec(path, axes, hf_name, "linear", num_in, quantize=True, **kw)


PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec(("embed",), (VOCAB, EMBED), "model.embed_tokens.weight", "same"),  # VD
    ParamSpec(("layers", "input_norm", "scale"), (EMBED,), LAYER + "input_layernorm.weight", init="ones"),
    linear(ATTN + ("q_proj",), (EMBED, HEADS, HEAD_DIM), LAYER + "self_attn.q_proj.weight"),  # DNH
    linear(ATTN + ("k_proj",), (EMBED, KV_HEADS, HEAD_DIM), LAYER + "self_attn.k_proj.weight"),  # DKH
    linear(ATTN + ("v_proj",), (EMBED, KV_HEADS, HEAD_DIM), LAYER + "self_attn.v_proj.weight"),  # DKH
    linear(ATTN + ("o_proj",), (HEADS, HEAD_DIM, EMBED), LAYER + "self_attn.o_proj.weight", num_in=2),  # NHD
    ParamSpec(
        ATTN + ("q_bias",),
        (HEADS, HEAD_DIM),
        LAYER + "self_attn.q_proj.bias",
        init="zeros",
        exists=lambda c: c.qkv_bias,
    ),
    ParamSpec(
        ATTN + ("k_bias",),
        (KV_HEADS, HEAD_DIM),
        LAYER + "self_attn.k_proj.bias",
        init="zeros",
        exists=lambda c: c.qkv_bias,
    ),
    ParamSpec(
        ATTN + ("v_bias",),
        (KV_HEADS, HEAD_DIM),
        LAYER + "self_attn.v_proj.bias",
        init="zeros",
        exists=lambda c: c.qkv_bias,
    ),
    ParamSpec(ATTN + ("o_bias",), (EMBED,), LAYER + "self_attn.o_proj.bias", init="zeros", exists=lambda c: c.o_bias),
    ParamSpec(
        ("layers", "post_attention_norm", "scale"), (EMBED,), LAYER + "post_attention_layernorm.weight", init="ones"
    ),
    linear(("layers", "mlp", "gate_proj"), (EMBED, MLP), LAYER + "mlp.gate_proj.weight"),  # DF
    linear(("layers", "mlp", "up_proj"), (EMBED, MLP), LAYER + "mlp.up_proj.weight"),  # DF
    linear(("layers", "mlp", "down_proj"), (MLP, EMBED), LAYER + "mlp.down_proj.weight"),  # FD
    ParamSpec(("final_norm", "scale"), (EMBED,), "model.norm.weight", init="ones"),
    ParamSpec(("lm_head",), (EMBED, VOCAB), "lm_head.weight", "linear", 1, exists=lambda c: not c.tie_word_embeddings),
)

ARCHITECTURE = Architecture("llama", ("LlamaForCausalLM",), PARAMS)
