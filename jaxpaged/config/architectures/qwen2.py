"""Qwen2: Llama's parameters with q/k/v biases always (whatever `attention_bias` says), and a
sliding window only where config.json opts in."""

from jaxpaged.config.architectures import Architecture
from jaxpaged.config.architectures.llama import PARAMS

ARCHITECTURE = Architecture("qwen2", ("Qwen2ForCausalLM",), PARAMS, biases="qkv", sliding_window_opt_in=True)
