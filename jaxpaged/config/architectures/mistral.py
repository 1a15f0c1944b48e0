"""Mistral: Llama's parameters; its `sliding_window` always applies."""

from jaxpaged.config.architectures import Architecture
from jaxpaged.config.architectures.llama import PARAMS

ARCHITECTURE = Architecture("mistral", ("MistralForCausalLM",), PARAMS)
