"""jaxpaged: PagedAttention LLM inference in pure JAX/Pallas."""

from jaxpaged.config import ModelConfig

__all__ = ["ModelConfig"]
