"""Qwen2-MoE: Qwen2's attention (q/k/v biases, unless config.json's `qkv_bias` is false) and a
sparse MLP in every layer (see mixtral.py) beside a shared SwiGLU expert whose output is scaled by
`sigmoid(x . shared_expert_gate)`.

Dimension letters: D hidden, S the shared expert's FFN width.
"""

from jaxpaged.config.architectures import Architecture
from jaxpaged.config.architectures.llama import LAYER, linear
from jaxpaged.config.architectures.llama import PARAMS as LLAMA_PARAMS
from jaxpaged.config.architectures.mixtral import MOE, sparse_params
from jaxpaged.config.architectures.qwen3_moe import EXPERT_NAMES
from jaxpaged.config.params.spec import EMBED, SHARED_MLP, ParamSpec

SHARED = LAYER + "mlp.shared_expert."

SHARED_PARAMS = (
    linear(MOE + ("shared_gate_proj",), (EMBED, SHARED_MLP), SHARED + "gate_proj.weight"),  # DS
    linear(MOE + ("shared_up_proj",), (EMBED, SHARED_MLP), SHARED + "up_proj.weight"),  # DS
    linear(MOE + ("shared_down_proj",), (SHARED_MLP, EMBED), SHARED + "down_proj.weight"),  # SD
    ParamSpec(MOE + ("shared_expert_gate",), (EMBED,), LAYER + "mlp.shared_expert_gate.weight", "linear", 1),  # D
)
PARAMS = sparse_params(LLAMA_PARAMS, "mlp.", "gate", "experts.{expert}.", EXPERT_NAMES, SHARED_PARAMS)

ARCHITECTURE = Architecture(
    "qwen2_moe", ("Qwen2MoeForCausalLM",), PARAMS, biases="qkv_bias", sliding_window_opt_in=True, moe="qwen"
)
