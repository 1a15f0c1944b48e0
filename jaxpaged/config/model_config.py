"""Model configuration: the static description of a Llama-family network.

`ModelConfig.from_hf` reads a Hugging Face `config.json` dictionary (the architectures of
`jaxpaged.config.architectures`: Llama, Mistral, Qwen2, Qwen3 and Phi-3 causal LMs, and the
Mixtral, Qwen2-MoE and Qwen3-MoE mixtures of experts) and refuses anything this engine would compute differently from
transformers, naming the field, its value and what would fix it.
"""

import dataclasses
import math
import os
from typing import Any

from jaxpaged.config.moe import MoeConfig, moe_from_hf
from jaxpaged.config.presets import read_config_json

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# config.json's `hidden_act` (`hidden_activation`) values the MLP computes.
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# config.json's `layer_types` entries: a layer attends to every earlier token or to a window.
LAYER_TYPES = ("full_attention", "sliding_attention")
# Older Phi-3 configs' names for LongRoPE (as transformers reads them).
LONGROPE_ALIASES = ("su", "yarn")


# The most input features per group a per-channel checkpoint's weights are held in (their one
# scale per output channel repeated over its groups): few enough groups per projection that any
# tensor-parallel size up to 8 splits them.
PER_CHANNEL_GROUP_CAP = 128


@dataclasses.dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters.

    Attributes:
      theta: base of the inverse frequencies (`rope_theta`).
      rope_type: one of `SUPPORTED_ROPE_TYPES`.
      factor: scaling factor for "linear" and "llama3".
      low_freq_factor, high_freq_factor: "llama3" only.
      original_max_position_embeddings: the pre-training context ("llama3", "longrope").
      partial_rotary_factor: the fraction of each head's features rotated (the first
        `rotary_dim`; Phi-4-mini rotates 3/4); the rest pass through.
      short_factor, long_factor: "longrope": each frequency's divisor for contexts within
        `original_max_position_embeddings` and beyond it.
      use_long_factor: "longrope": the engine's contexts reach beyond the pre-training context,
        so every position uses `long_factor` (`ModelConfig.for_max_model_len`; transformers
        switches per sequence length, which a shared KV cache cannot).
      attention_factor: cos and sin are multiplied by it ("longrope": `sqrt(1 + ln(s) /
        ln(original))`, s the context's growth, for short and long contexts alike).
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    use_long_factor: bool = False
    attention_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        """The features of a head that are rotated."""
        return int(head_dim * self.partial_rotary_factor)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """Static configuration of a decoder-only Llama-family model (hashable, jit-static).

    Attributes:
      architecture: "llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe" or "qwen3_moe" (declared, with its parameter table, in
        `jaxpaged.config.architectures`).
      vocab_size: V, rows of the embedding table.
      hidden_size: D, the residual width.
      intermediate_size: F, the MLP width.
      num_layers: number of decoder layers.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads (N % K == 0; N // K = G query heads per KV head).
      head_dim: H, width of one head (explicit in Mistral/Qwen3-style configs).
      rms_norm_eps: epsilon of every RMSNorm.
      rope: rotary embedding parameters.
      max_position_embeddings: the longest context the checkpoint supports.
      tie_word_embeddings: the LM head reuses the embedding table.
      qkv_bias: q/k/v projections carry a bias (Qwen2, or Llama with attention_bias).
      o_bias: the output projection carries a bias (Llama with attention_bias).
      sliding_window: the sliding window (a query sees the `sliding_window` latest keys, itself
        included) of the layers `layer_types` names sliding, or None: every layer full.
      layer_types: each layer's `LAYER_TYPES` entry (Gemma 3's local and global layers, Qwen2's
        layers from `max_window_layers`); empty: every layer slides when `sliding_window` is set
        (Mistral).
      local_rope: the sliding layers' rotary embedding where it differs from `rope` (Gemma 3's
        `rope_local_base_freq`), or None.
      hidden_act: the MLP's activation, one of `SUPPORTED_ACTIVATIONS`.
      query_pre_attn_scalar: the softmax scale is its inverse square root (Gemma 3); None:
        `head_dim`'s.
      bos_token_id, eos_token_ids: special tokens from the config (may be empty).
      moe: every layer's sparse MLP (Mixtral, Qwen2-MoE, Qwen3-MoE), or None: a dense MLP.
      weight_bits, weight_group_size: the decoder projections' bits and input features per group
        when they are group-quantized (see `with_weight_groups`); None otherwise.
      weight_act_order: group-quantized with the inputs permuted (GPTQ `desc_act`).
      float_weights: the paths (in the parameter table) of the projections a group-quantized
        checkpoint stores in float in every layer (and expert), e.g. an AWQ checkpoint's
        `modules_to_not_convert`; the model holds them plain (see `with_weight_groups`).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    local_rope: RopeConfig | None = None
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    moe: MoeConfig | None = None
    weight_bits: int | None = None
    weight_group_size: int | None = None
    weight_act_order: bool = False
    float_weights: tuple[tuple[str, ...], ...] = ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )

    def with_weight_groups(
        self,
        groups: tuple[int, int | None] | None,
        act_order: bool = False,
        field: str = "quantization_group_size",
        float_weights: tuple[tuple[str, ...], ...] = (),
    ) -> "ModelConfig":
        """This model with its decoder projections group-quantized: `groups` is `(bits,
        group_size)` (`jaxpaged.config.quantization.weight_groups`), None for none; `act_order`:
        the checkpoint's groups are not contiguous (GPTQ `desc_act`), so each projection keeps a
        permutation of its inputs (see `jaxpaged.config.params`); `float_weights`: the paths of
        the projections left in float (`jaxpaged.params.tables.float_weights`). A group size of None (one group
        per output channel, which differs between projections of different widths) becomes the
        largest size dividing every projection's inputs and `PER_CHANNEL_GROUP_CAP`: each
        channel's scale and zero point repeated over its groups hold the same weights.

        Args:
          field: what sets the group size, named in errors.

        Raises:
          ValueError: the group size does not divide a projection's input features (naming both).
        """
        if groups is None:
            return dataclasses.replace(
                self, weight_bits=None, weight_group_size=None, weight_act_order=False, float_weights=()
            )
        bits, group_size = groups
        inputs = {"hidden_size": self.hidden_size, "num_attention_heads * head_dim": self.num_heads * self.head_dim}
        if self.moe is None:
            inputs["intermediate_size"] = self.intermediate_size
        else:  # each expert's projections quantized alone
            inputs["each expert's intermediate size"] = self.moe.expert_size
            if self.moe.shared_expert_size:
                inputs["shared_expert_intermediate_size"] = self.moe.shared_expert_size
        if group_size is None:  # capped so tensor parallelism can split the groups (8B's gcd, 2048, gives 7 MLP groups)
            group_size = math.gcd(*inputs.values(), PER_CHANNEL_GROUP_CAP)
        for name, size in inputs.items():
            if group_size < 1 or size % group_size:
                raise ValueError(
                    f"{field}={group_size} does not divide {name}={size} (a projection's input "
                    "features, quantized in groups of that many); pick a group size that divides it"
                )
        return dataclasses.replace(
            self,
            weight_bits=bits,
            weight_group_size=group_size,
            weight_act_order=act_order,
            float_weights=float_weights,
        )

    @property
    def max_context_len(self) -> int:
        """Longest context computed exactly: the position limit (sliding windows are computed
        at any length)."""
        return self.max_position_embeddings

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None: it attends to every earlier token."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def rope_of(self, layer: int) -> RopeConfig:
        """Layer `layer`'s rotary embedding (a sliding layer's `local_rope` where there is one)."""
        if self.local_rope is not None and self.window_of(layer) is not None:
            return self.local_rope
        return self.rope

    @property
    def layers_alike(self) -> bool:
        """Every layer has the same window and rotary embedding (so both are trace-time constants)."""
        return len({(self.window_of(i), self.rope_of(i)) for i in range(self.num_layers)}) == 1

    @property
    def softmax_scale(self) -> float:
        """The attention logits' scale."""
        return (self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar) ** -0.5

    def check_max_model_len(self, max_model_len: int) -> int:
        """Validates a requested context length and returns it.

        Raises:
          ValueError: when it exceeds the position limit.
        """
        if max_model_len < 1:
            raise ValueError(f"max_model_len={max_model_len} must be at least 1")
        if max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's "
                f"max_position_embeddings={self.max_position_embeddings}; pass a smaller max_model_len"
            )
        return max_model_len

    def for_max_model_len(self, max_model_len: int) -> "ModelConfig":
        """This model as an engine of `max_model_len` computes it: LongRoPE's long factors for
        every position when its contexts may grow beyond the pre-training context (as vLLM
        chooses), its short ones otherwise."""
        if self.rope.rope_type != "longrope":
            return self
        long = max_model_len > self.rope.original_max_position_embeddings
        return dataclasses.replace(self, rope=dataclasses.replace(self.rope, use_long_factor=long))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Builds a config from a Hugging Face `config.json` dictionary.

        Args:
          hf: the parsed config.json (transformers 4.x `rope_theta`/`rope_scaling` or
            5.x `rope_parameters` style).

        Raises:
          ValueError: naming the field and value of anything unsupported.
        """
        from jaxpaged.config.architectures import BY_HF_NAME  # its tables are written against this module

        archs = hf.get("architectures") or []
        arch = next((BY_HF_NAME[a] for a in archs if a in BY_HF_NAME), None)
        if arch is None:
            raise ValueError(f"architectures={archs!r} is not supported; jaxpaged runs {sorted(BY_HF_NAME)}")
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
        return cls(
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
            query_pre_attn_scalar=None
            if hf.get("query_pre_attn_scalar") is None
            else float(hf["query_pre_attn_scalar"]),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            moe=None if arch.moe is None else moe_from_hf(arch.moe, hf),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        """Reads `config.json` from a model directory (HF or converted)."""
        return cls.from_hf(read_config_json(model_dir))


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of K and V cached per token over all layers: 2 x layers x kv_heads x head_dim x bytes."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes


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
