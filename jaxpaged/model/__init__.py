"""The Llama-family model in Flax NNX and its paged-attention metadata."""

from jaxpaged.model.llama import KVPool, Llama, init_kv_pool
from jaxpaged.model.metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "KVPool", "Llama", "init_kv_pool"]
