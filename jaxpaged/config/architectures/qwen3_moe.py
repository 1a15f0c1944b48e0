"""Qwen3-MoE: Qwen3's attention (q/k norms) and a sparse MLP in every layer (see mixtral.py);
the router renormalises its top-k only with `norm_topk_prob`."""

from jaxpaged.config.architectures import Architecture
from jaxpaged.config.architectures.mixtral import sparse_params
from jaxpaged.config.architectures.qwen3 import PARAMS as QWEN3_PARAMS

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")

PARAMS = sparse_params(QWEN3_PARAMS, "mlp.", "gate", "experts.{expert}.", EXPERT_NAMES)

ARCHITECTURE = Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), PARAMS, sliding_window_opt_in=True, moe="qwen")
