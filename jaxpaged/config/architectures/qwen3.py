"""Qwen3's parameters: the Llama family's, and an RMSNorm scale over each head's q and k (applied
per head before RoPE)."""

from jaxpaged.config.architectures import Architecture
from jaxpaged.config.architectures.llama import ATTN, LAYER
from jaxpaged.config.architectures.llama import PARAMS as LLAMA_PARAMS
from jaxpaged.config.params.spec import HEAD_DIM, ParamSpec

PARAMS: tuple[ParamSpec, ...] = (
    *LLAMA_PARAMS,
    ParamSpec(ATTN + ("q_norm",), (HEAD_DIM,), LAYER + "self_attn.q_norm.weight", init="ones"),
    ParamSpec(ATTN + ("k_norm",), (HEAD_DIM,), LAYER + "self_attn.k_norm.weight", init="ones"),
)

ARCHITECTURE = Architecture("qwen3", ("Qwen3ForCausalLM",), PARAMS, sliding_window_opt_in=True)
