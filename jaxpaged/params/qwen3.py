"""Qwen3's parameters: the Llama family's, and an RMSNorm scale over each head's q and k (applied
per head before RoPE)."""

from jaxpaged.params.llama import ATTN, LAYER
from jaxpaged.params.llama import PARAMS as LLAMA_PARAMS
from jaxpaged.params.spec import HEAD_DIM, ParamSpec

PARAMS: tuple[ParamSpec, ...] = (
    *LLAMA_PARAMS,
    ParamSpec(ATTN + ("q_norm",), (HEAD_DIM,), LAYER + "self_attn.q_norm.weight", init="ones"),
    ParamSpec(ATTN + ("k_norm",), (HEAD_DIM,), LAYER + "self_attn.k_norm.weight", init="ones"),
)
