"""The paged KV pool: per layer K and V of shape `[NB, BS, K, H]`, block 0 the null block.

Storage dtype. XLA's CPU backend has no bfloat16 (or float8) gather: it converts the operand of
every such gather to float32 first, and the operand here is a layer's whole pool. A step over a
bfloat16 pool would then build a float32 copy of every layer's pool (temporaries growing with
the pool, per-token time with them). On CPU such pools are therefore stored in float32. The
values are still exactly the model dtype's (they are written from projections computed in that
dtype), so results are unchanged; the pool takes twice the bytes, and the planner counts them.
GPUs gather bfloat16 natively and store the dtype asked for.
"""

import dataclasses
import typing

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from jaxpaged.config.model_config import ModelConfig

# Dtypes XLA's CPU backend cannot gather without converting the whole operand to float32.
_CPU_UPCAST = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def kv_storage_dtype(dtype, platform: str | None = None) -> jnp.dtype:
    """The dtype a KV pool of `dtype` is stored in on `platform` (default: JAX's default backend).

    Args:
      dtype: the model's (logical) KV dtype.
      platform: "cpu", "gpu", "cuda", ...; None asks `jax.default_backend()`.
    """
    dtype = jnp.dtype(dtype)
    platform = platform or jax.default_backend()
    if platform == "cpu" and dtype.name in _CPU_UPCAST:
        return jnp.dtype(jnp.float32)
    return dtype


@typing.no_type_check  # JAX rebuilds pytrees from non-array leaves (ArgInfo, specs)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    """The paged KV cache: per layer, K and V of shape `[NB, BS, K, H]`; block 0 is the null block."""

    k: tuple[Float[Array, "NB BS K H"], ...]
    v: tuple[Float[Array, "NB BS K H"], ...]

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def block_size(self) -> int:
        return self.k[0].shape[1]


def init_kv_pool(config: ModelConfig, num_blocks: int, block_size: int, dtype, platform: str | None = None) -> KVPool:
    """A zeroed pool of `num_blocks` blocks (block 0 included) for every layer, stored in
    `kv_storage_dtype(dtype, platform)`."""
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    storage = kv_storage_dtype(dtype, platform)
    return KVPool(
        k=tuple(jnp.zeros(shape, storage) for _ in range(config.num_layers)),
        v=tuple(jnp.zeros(shape, storage) for _ in range(config.num_layers)),
    )
