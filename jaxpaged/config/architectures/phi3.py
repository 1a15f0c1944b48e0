"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): Llama's network, its checkpoint fusing q, k and v into
one `qkv_proj` and the MLP's gate and up into one `gate_up_proj` (the parts follow one another
along the outputs: `Fused`); a partial rotary embedding and LongRoPE come from config.json
(`jaxpaged.config.model_config`); its `sliding_window` always applies.

Dimension letters: D hidden, N query heads, K kv heads, H head_dim, F MLP width.
"""

import dataclasses

from jaxpaged.config.architectures import Architecture
from jaxpaged.config.architectures.llama import LAYER
from jaxpaged.config.architectures.llama import PARAMS as LLAMA_PARAMS
from jaxpaged.config.params.spec import HEAD_DIM, HEADS, KV_HEADS, MLP, Fused

QKV = ((HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM), (KV_HEADS, HEAD_DIM))  # qkv_proj's rows: N*H, K*H, K*H
GATE_UP = ((MLP,), (MLP,))  # gate_up_proj's rows: F, F
FUSED = {
    "q_proj": ("self_attn.qkv_proj.weight", Fused(QKV, 0)),
    "k_proj": ("self_attn.qkv_proj.weight", Fused(QKV, 1)),
    "v_proj": ("self_attn.qkv_proj.weight", Fused(QKV, 2)),
    "gate_proj": ("mlp.gate_up_proj.weight", Fused(GATE_UP, 0)),
    "up_proj": ("mlp.gate_up_proj.weight", Fused(GATE_UP, 1)),
}

PARAMS = tuple(
    dataclasses.replace(spec, hf_name=LAYER + FUSED[spec.name][0], fused=FUSED[spec.name][1])
    if spec.name in FUSED
    else spec
    for spec in LLAMA_PARAMS
    if spec.path[-1] not in ("q_bias", "k_bias", "v_bias", "o_bias")  # Phi-3 has no biases
)

ARCHITECTURE = Architecture("phi3", ("Phi3ForCausalLM",), PARAMS)
