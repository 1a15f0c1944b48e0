"""Model configuration: the static description of a Llama-family network (a Hugging Face
config.json becomes one in `jaxpaged.config.hf_config`)."""

import dataclasses
import math

from jaxpaged.config.checks import OptionError
from jaxpaged.config.moe import MoeConfig

# config.json's `layer_types` entries: a layer attends to every earlier token or to a window.
LAYER_TYPES = ("full_attention", "sliding_attention")


# The most input features per group a per-channel checkpoint's weights are held in (their one
# scale per output channel repeated over its groups): few enough groups per projection that any
# tensor-parallel size up to 8 splits them.
PER_CHANNEL_GROUP_CAP = 128


@dataclasses.dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters.

    Attributes:
      theta: base of the inverse frequencies (`rope_theta`).
      rope_type: one of `jaxpaged.config.hf_config.SUPPORTED_ROPE_TYPES`.
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
      hidden_act: the MLP's activation, one of `jaxpaged.config.hf_config.SUPPORTED_ACTIVATIONS`.
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
        permutation of its inputs (see `jaxpaged.config.params.spec`); `float_weights`: the paths of
        the projections left in float (`jaxpaged.config.params.tables.float_weights`). A group size of None (one group
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
          OptionError: naming `max_model_len`, when it is below 1 or exceeds the position limit.
        """
        if max_model_len < 1:
            raise OptionError("max_model_len", max_model_len, "must be at least 1")
        if max_model_len > self.max_position_embeddings:
            raise OptionError(
                "max_model_len",
                max_model_len,
                f"exceeds the model's max_position_embeddings={self.max_position_embeddings}; "
                f"ask for {self.max_position_embeddings} tokens or fewer",
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


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of K and V cached per token over all layers: 2 x layers x kv_heads x head_dim x bytes."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype_bytes
