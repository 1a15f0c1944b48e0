"""A Hugging Face `config.json` read as a `ModelConfig`: the architectures of
`jaxpaged.config.architectures` (Llama, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 3 causal LMs, and
the Mixtral, Qwen2-MoE and Qwen3-MoE mixtures of experts), each config.json's rules (biases,
sliding windows, rotary embeddings per layer type, defaults) as transformers reads them; anything
this engine would compute differently from transformers is refused, naming the field, its value
and what would fix it.

Reading sits above the architectures' tables (which are written against `ModelConfig`), so the
imports run one way: model_config <- config.params.spec <- config.architectures <- hf_config
(and the tables derived from the architectures, `config.params.tables`).
"""

import math
import os
from typing import Any

from jaxpaged.config.architectures import BY_HF_NAME
from jaxpaged.config.model_config import LAYER_TYPES, ModelConfig, RopeConfig
from jaxpaged.config.moe import moe_from_hf
from jaxpaged.config.presets import read_config_json

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# config.json's `hidden_act` (`hidden_activation`) values the MLP computes.
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Older Phi-3 configs' names for LongRoPE (as transformers reads them).
LONGROPE_ALIASES = ("su", "yarn")


def model_config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Builds a config from a Hugging Face `config.json` dictionary.

    Args:
      hf: the parsed config.json (transformers 4.x `rope_theta`/`rope_scaling` or
        5.x `rope_parameters` style).

    Raises:
      ValueError: naming the field and value of anything unsupported.
    """
    archs = hf.get("architectures") or []
    arch = next((BY_HF_NAME[a] for a in archs if a in BY_HF_NAME), None)
    if arch is None:
        raise ValueError(f"architectures={archs!r} is not supported; jaxpaged runs {sorted(BY_HF_NAME)}")
    if arch.text_config is not None:  # the language model's own config, the class name above it
        text = hf.get(arch.text_config)
        if not isinstance(text, dict):
            raise ValueError(f"{archs[0]}: config.json has no {arch.text_config!r} describing its language model")
        top = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in hf}
        hf = {**top, **text, "architectures": archs}
    hf = {**dict(arch.hf_defaults), **hf}
    act = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS or (act != "silu" and arch.moe is not None):
        raise ValueError(
            f"hidden_act={act!r} is not supported here; supported: {', '.join(SUPPORTED_ACTIVATIONS)} (experts: silu)"
        )
    for field in ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
        if hf.get(field):
            raise ValueError(f"{field}={hf[field]!r} is not supported (only null/false)")
    if hf.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    if hf.get("pretraining_tp", 1) != 1:
        raise ValueError(f"pretraining_tp={hf['pretraining_tp']} is not supported (only 1)")
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    head_dim = hf.get("head_dim") or hidden // num_heads
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    attention_bias = bool(hf.get("attention_bias", False))
    qkv_bias = {"qkv": True, "qkv_bias": bool(hf.get("qkv_bias", True))}.get(arch.biases, attention_bias)
    rope, local_rope = _ropes_from_hf(hf, int(head_dim))
    window = _sliding_window_from_hf(arch.sliding_window_opt_in, hf)
    return ModelConfig(
        architecture=arch.name,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope,
        local_rope=local_rope,
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=arch.biases == "attention_bias" and attention_bias,
        sliding_window=window,
        layer_types=_layer_types_from_hf(arch.sliding_window_opt_in, hf, window),
        hidden_act=act,
        query_pre_attn_scalar=None if hf.get("query_pre_attn_scalar") is None else float(hf["query_pre_attn_scalar"]),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        moe=None if arch.moe is None else moe_from_hf(arch.moe, hf),
    )


def read_model_config(model_dir: str | os.PathLike) -> ModelConfig:
    """Reads `config.json` from a model directory (HF or converted)."""
    return model_config_from_hf(read_config_json(model_dir))


def _rope_from_hf(hf: dict[str, Any], head_dim: int) -> RopeConfig:
    params = dict(hf.get("rope_parameters") or {})
    params.update(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = "longrope" if rope_type in LONGROPE_ALIASES else rope_type
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling.rope_type={rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if not 0 < partial <= 1 or rotary_dim % 2:
        raise ValueError(
            f"partial_rotary_factor={partial} rotates {rotary_dim} of head_dim={head_dim} features; it must be "
            "in (0, 1] and rotate an even number of them"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta, partial_rotary_factor=partial)
    if rope_type == "longrope":
        return _longrope_from_hf(hf, params, theta, partial, rotary_dim)
    if partial != 1:
        raise ValueError(f"partial_rotary_factor={partial} with rope_type={rope_type!r} is not supported")
    factor = float(params["factor"])
    if rope_type == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def _longrope_from_hf(
    hf: dict[str, Any], params: dict[str, Any], theta: float, partial: float, rotary_dim: int
) -> RopeConfig:
    """Phi-3's LongRoPE, as transformers reads it: the growth `factor` defaults to
    max_position_embeddings / original_max_position_embeddings, and the attention factor to
    `sqrt(1 + ln(factor) / ln(original))` (1 when the context does not grow)."""
    original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
    if original is None:
        raise ValueError("rope_scaling.rope_type='longrope' needs original_max_position_embeddings")
    original = int(original)
    factors = {}
    for name in ("short_factor", "long_factor"):
        values = params.get(name)
        if not isinstance(values, (list, tuple)) or len(values) != rotary_dim // 2:
            raise ValueError(
                f"rope_scaling.{name} must list {rotary_dim // 2} numbers (one per rotated frequency of "
                f"{rotary_dim} rotary features), got {values!r}"
            )
        factors[name] = tuple(float(v) for v in values)
    factor = params.get("factor")
    factor = float(hf.get("max_position_embeddings", 2048)) / original if factor is None else float(factor)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeConfig(
        theta=theta,
        rope_type="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        partial_rotary_factor=partial,
        attention_factor=float(attention),
        **factors,
    )


def _ropes_from_hf(hf: dict[str, Any], head_dim: int) -> tuple[RopeConfig, RopeConfig | None]:
    """The full layers' rotary embedding and, where it differs, the sliding layers': from
    `rope_parameters` per layer type (transformers 5's Gemma 3), or `rope_local_base_freq` (4.x)."""
    params = hf.get("rope_parameters") or {}
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
    if set(params) & set(LAYER_TYPES):
        full, local = ({**plain, "rope_parameters": params.get(t) or {}} for t in LAYER_TYPES)
        rope, local_rope = _rope_from_hf(full, head_dim), _rope_from_hf(local, head_dim)
    elif "rope_local_base_freq" in hf:
        rope = _rope_from_hf(hf, head_dim)
        local_rope = _rope_from_hf({**plain, "rope_theta": hf["rope_local_base_freq"]}, head_dim)
    else:
        return _rope_from_hf(hf, head_dim), None
    if (
        local_rope.rotary_dim(head_dim) != rope.rotary_dim(head_dim)
        or local_rope.attention_factor != rope.attention_factor
    ):
        raise ValueError(
            "the sliding layers' rotary embedding rotates other features or scales otherwise than the "
            f"full layers' ({local_rope} against {rope}); not supported"
        )
    return rope, None if local_rope == rope else local_rope


def _layer_types_from_hf(opt_in: bool, hf: dict[str, Any], window: int | None) -> tuple[str, ...]:
    """`ModelConfig.layer_types`: config.json's own list, Gemma 3's `sliding_window_pattern` (each
    pattern's last layer full), or Qwen2's layers from `max_window_layers` on; () for Mistral's
    every-layer window and for models without one."""
    if window is None:
        return ()
    num_layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if types is None and hf.get("sliding_window_pattern"):
        pattern = int(hf["sliding_window_pattern"])
        types = [LAYER_TYPES[bool((i + 1) % pattern)] for i in range(num_layers)]
    elif types is None and opt_in:
        first = int(hf.get("max_window_layers", num_layers))
        types = [LAYER_TYPES[i >= first] for i in range(num_layers)]
    if types is None:
        return ()
    if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"layer_types={types!r} must name one of {LAYER_TYPES} for each of the {num_layers} layers")
    return tuple(types)


def _sliding_window_from_hf(opt_in: bool, hf: dict[str, Any]) -> int | None:
    window = hf.get("sliding_window")
    if window is None:
        return None
    if opt_in:
        # e.g. Qwen2 and Qwen3 apply the window only when use_sliding_window is set (and then per layer).
        layer_types = hf.get("layer_types") or []
        if not hf.get("use_sliding_window", False) and "sliding_attention" not in layer_types:
            return None
    return int(window)
