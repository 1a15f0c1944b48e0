"""Tiny random-initialised Hugging Face models, built and saved inside the tests (no downloads)."""

import os
from typing import Any

import torch
import transformers

BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

# name -> (config class, model class, overrides of BASE)
VARIANTS = {
    "llama_mha": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "llama_gqa4": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16),
    ),
    "llama_gqa8": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(num_attention_heads=8, num_key_value_heads=1, head_dim=8),
    ),
    "llama3_rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(
            num_key_value_heads=2,
            max_position_embeddings=1024,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=128,
            ),
        ),
    ),
    "llama_linear_rope": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(rope_scaling=dict(rope_type="linear", factor=2.0)),
    ),
    "llama_tied": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "qwen2_bias": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(num_key_value_heads=2, tie_word_embeddings=True),
    ),
    # q and k RMS-normed per head (head_dim 16 explicit, as Qwen3 configs give it)
    "qwen3_qk_norm": (
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        dict(num_key_value_heads=2, head_dim=16),
    ),
    # head_dim 64, as the Pallas kernels require
    "llama_hd64": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    ),
    "mistral": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(num_key_value_heads=2, head_dim=32, sliding_window=None),
    ),
    # Phi-3/Phi-4: fused qkv_proj and gate_up_proj in the checkpoint; Phi-4-mini's partial rotary
    # embedding (3/4 of 16 features) and LongRoPE (contexts up to 300 < 512: its short factors,
    # and an attention factor > 1 from 2048 / 512)
    "phi3_longrope": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            num_key_value_heads=2,
            pad_token_id=0,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
            original_max_position_embeddings=512,
            partial_rotary_factor=0.75,
            rope_scaling=dict(
                type="longrope",
                short_factor=[1.0 + 0.2 * i for i in range(6)],
                long_factor=[2.0 + 1.5 * i for i in range(6)],
            ),
        ),
    ),
    "phi4": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(num_key_value_heads=2, pad_token_id=0, original_max_position_embeddings=1024),
    ),
    # Gemma 3: two sliding layers (a window of 7, across block edges) with their own rotary base,
    # then a full one with linear scaling; softmax scale from query_pre_attn_scalar (not head_dim),
    # GELU-tanh, 1 + w norms before and after attention and MLP, scaled embeddings
    "gemma3": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=7,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
            tie_word_embeddings=True,
            pad_token_id=0,
        ),
    ),
    # Mistral's sliding window on every layer (a trace-time constant), contexts far past it
    "mistral_window": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(num_key_value_heads=2, head_dim=32, sliding_window=12),
    ),
    # Tensor-parallel variants: 8 query heads split over up to 8 devices, fewer kv heads than that.
    "llama_tp": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8),
    ),
    # Pipeline-parallel variant: 5 layers, which 2 and 4 stages split unevenly (3 + 2, 2 + 1 + 1 + 1)
    "llama_pp": (
        transformers.LlamaConfig,
        transformers.LlamaForCausalLM,
        dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8, num_hidden_layers=5),
    ),
    # a vocabulary of 500 splits over 2 and 4 devices but stays whole over 8
    "qwen2_tp": (
        transformers.Qwen2Config,
        transformers.Qwen2ForCausalLM,
        dict(vocab_size=500, num_attention_heads=8, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True),
    ),
    # head_dim 64 / 8 = 8, half of it rotated
    "phi3_tp": (
        transformers.Phi3Config,
        transformers.Phi3ForCausalLM,
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            pad_token_id=0,
            partial_rotary_factor=0.5,
            original_max_position_embeddings=1024,
        ),
    ),
    # Gemma 3 over up to 8 devices: q/k norms and the norms after attention and MLP replicated
    "gemma3_tp": (
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        dict(
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            query_pre_attn_scalar=12,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            tie_word_embeddings=True,
            pad_token_id=0,
        ),
    ),
    "mistral_tp": (
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16, sliding_window=None),
    ),
    # Mixtures of experts: 8 experts, top-2, renormalised (Mixtral); top-2 of 4 with a gated shared
    # expert, not renormalised (Qwen2-MoE); top-8 of 16, renormalised, q/k norms (Qwen3-MoE)
    "mixtral_moe": (
        transformers.MixtralConfig,
        transformers.MixtralForCausalLM,
        dict(num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
    ),
    "qwen2_moe": (
        transformers.Qwen2MoeConfig,
        transformers.Qwen2MoeForCausalLM,
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
        ),
    ),
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            num_key_value_heads=2,
            head_dim=16,
            num_experts=16,
            num_experts_per_tok=8,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
    # Expert parallelism over 8 devices: 8 query heads, 16 experts (2 per device), top-4
    "qwen3_moe_tp": (
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    ),
}


def build_hf_model(name: str, seed: int = 0, **config: Any) -> transformers.PreTrainedModel:
    """A float32 random model of the named variant (its config changed by `config`), in eval mode."""
    config_cls, model_cls, overrides = VARIANTS[name]
    torch.manual_seed(seed)
    config = config_cls(**{**BASE, **overrides, **config})
    return widen_weights(model_cls(config).eval())


def widen_weights(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """`model` with wider random weights, in place. HF's default init (std 0.02, unit norms, zero
    biases) gives near-uniform logits whose argmax is decided by rounding. Wider weights make
    greedy decoding a real test, and non-trivial norms and biases make every parameter matter."""
    with torch.no_grad():
        for name_, param in model.named_parameters():
            if name_.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            elif param.dim() == 1:
                param.normal_(0, 0.5)
            else:
                param.normal_(0, 0.15)
    return model


def save_hf_model(
    name: str, out_dir: str, seed: int = 0, max_shard_size: str | None = None, **config: Any
) -> transformers.PreTrainedModel:
    """Builds the named variant (its config changed by `config`) and saves it (safetensors) to
    `out_dir`; returns the model."""
    model = build_hf_model(name, seed, **config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    assert os.path.exists(os.path.join(out_dir, "config.json"))
    return model
