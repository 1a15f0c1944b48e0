"""The Llama-family model in Flax NNX, its paged-attention metadata and the token sampler
(`sampler`): the device functions `jaxpaged.functional.step` is made of."""

from jaxpaged.model.kv_pool import KVPool, KVQuant, init_kv_pool, kv_storage_dtype
from jaxpaged.model.layer_arrays import LayerArrays, state_shardings, unstack_layers
from jaxpaged.model.llama import Llama
from jaxpaged.model.metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "KVPool",
    "KVQuant",
    "LayerArrays",
    "Llama",
    "init_kv_pool",
    "kv_storage_dtype",
    "state_shardings",
    "unstack_layers",
]
