"""A compressed-tensors FP8 checkpoint built locally from a tiny random model (no downloads).

The layout of the public FP8 Llama checkpoints (llm-compressor's FP8 / FP8-dynamic schemes): every
decoder layer's q/k/v/o/gate/up/down `weight` in float8_e4m3fn `[out, in]` with a `weight_scale`
(`[out, 1]` per output channel, or one number per tensor), optionally a static `input_scale`
and KV cache scales; embedding, norms and LM head (compressed-tensors' `ignore`) stay plain;
config.json carries the `quantization_config`.
"""

import torch
from checkpoint_edits import save_quantized_checkpoint
from tiny_models import build_hf_model

FP8_MAX = 448.0  # the largest float8_e4m3fn
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
# A checkpoint that fuses q/k/v and gate/up (Phi-3) stores these instead.
FUSED_PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantization_config(strategy: str = "channel", static_input: bool = False, kv_cache: bool = False) -> dict:
    """A `quantization_config` as llm-compressor writes it for FP8 weights."""
    if static_input:
        activations = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    else:
        activations = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                "input_activations": activations,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "quantization_status": "compressed",
    }
    if kv_cache:
        config["kv_cache_scheme"] = {
            "num_bits": 8,
            "type": "float",
            "strategy": "tensor",
            "dynamic": False,
            "symmetric": True,
        }
    return config


def quantize_fp8(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`(weight float8_e4m3fn [out, in], scale float32)` of a float32 `[out, in]` weight: scale
    = amax / 448 per output row (`[out, 1]`) or over the tensor (`[]`)."""
    amax = w.abs().amax(dim=1, keepdim=True) if strategy == "channel" else w.abs().amax()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(torch.float32)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)  # torch turns overflow into NaN
    return q, scale


def save_fp8_checkpoint(
    variant: str,
    out_dir: str,
    strategy: str = "channel",
    seed: int = 0,
    static_input: bool = False,
    kv_cache: bool = False,
    scale_dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """Builds the tiny variant, quantizes its projections to FP8 and saves a compressed-tensors
    checkpoint (model.safetensors + config.json) to `out_dir`.

    Args:
      strategy: "channel" (`weight_scale` `[out, 1]`) or "tensor" (`weight_scale` `[]`).
      static_input: also store a static per-tensor `input_scale` `[1]` per projection.
      kv_cache: also store `self_attn.k_scale` / `v_scale` `[]` per layer.
      scale_dtype: the stored dtype of `weight_scale` (float32, or bfloat16 as some checkpoints).

    Returns:
      The dequantized float32 model (each projection's weight = fp8 * stored scale), the model
      the checkpoint stands for.
    """
    model = build_hf_model(variant, seed)
    tensors = {}
    with torch.no_grad():
        for name, param in model.state_dict().items():
            tensors[name] = param.detach().clone().contiguous()
        if model.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)  # shared with the embedding; safetensors stores it once
        fused = "model.layers.0.self_attn.qkv_proj.weight" in tensors  # Phi-3's
        for i in range(model.config.num_hidden_layers):
            for proj in FUSED_PROJECTIONS if fused else PROJECTIONS:
                prefix = f"model.layers.{i}.{proj}."
                q, scale = quantize_fp8(tensors[prefix + "weight"], strategy)
                scale = scale.to(scale_dtype)
                tensors[prefix + "weight"], tensors[prefix + "weight_scale"] = q, scale
                if static_input:
                    tensors[prefix + "input_scale"] = torch.tensor([0.02 + 0.001 * i])
                dequantized = q.to(torch.float32) * scale.to(torch.float32)
                model.get_submodule(f"model.layers.{i}.{proj}").weight.copy_(dequantized)
            if kv_cache:
                tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.05 + 0.01 * i)
                tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.04 + 0.01 * i)
    save_quantized_checkpoint(model, tensors, out_dir, quantization_config(strategy, static_input, kv_cache))
    return model
