"""The paged KV pool: K and V of all layers in one array each, `[L * NB, BS, K, H]`: layer l owns
blocks `l * NB .. (l + 1) * NB - 1`, and its first is that layer's null block. The model scans
over the layers with one array; the kernels read and write a layer's blocks at offset block ids.

Why not `[L, NB, BS, K, H]`: the model would reshape it to the kernels' `[L * NB, ...]` view, and
with one kv head per device XLA's CPU layout assignment gives that reshape another layout than
the pool's and copies the whole pool around the layer loop every step.

Storage dtype. XLA's CPU backend has no bfloat16 (or float8) gather: it converts the operand of
every such gather to float32 first, and the operand here is a layer's whole pool. A step over a
bfloat16 pool would then build a float32 copy of every layer's pool (temporaries growing with
the pool, per-token time with them). On CPU such pools are therefore stored in float32. The
values are still exactly the model dtype's (they are written from projections computed in that
dtype), so results are unchanged; the pool takes twice the bytes, and the planner counts them.
GPUs gather bfloat16 natively and store the dtype asked for.

An fp8 pool (`kv_cache_dtype` fp8 / fp8_e5m2) holds `saturate(x / scale)` rounded to its float8
type, with one scale per layer and kv head (`KVQuant`); the kernels quantize on write and fold
the scales into the attention on read (see `pallas_kernels`). On CPU it is stored in float32
like bfloat16 (the values stay exactly the float8 ones); on a GPU in float8, one byte each.
"""

import dataclasses
import typing

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

import pallas_kernels
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.quantization import is_fp8

# Dtypes XLA's CPU backend cannot gather without converting the whole operand to float32.
_CPU_UPCAST = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def kv_storage_dtype(dtype, platform: str | None = None) -> jnp.dtype:
    """The dtype a KV pool of `dtype` is stored in on `platform`.

    Args:
      dtype: the model's (logical) KV dtype.
      platform: "cpu", "gpu", "cuda", ...; None: `pallas_kernels.target_platform()`.
    """
    dtype = jnp.dtype(dtype)
    platform = platform or pallas_kernels.target_platform()
    if platform == "cpu" and dtype.name in _CPU_UPCAST:
        return jnp.dtype(jnp.float32)
    return dtype


@typing.no_type_check  # JAX rebuilds pytrees from non-array leaves (ArgInfo, specs)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVQuant:
    """How an fp8 pool is quantized: it holds `saturate(x / scale)` in `dtype`.

    Attributes:
      k_scale, v_scale: float32 scales, `[L, K]` in the pool (one layer's `[K]` inside a step).
      dtype: the float8 type's name ("float8_e4m3fn" or "float8_e5m2").
    """

    k_scale: Float[Array, "*L K"]
    v_scale: Float[Array, "*L K"]
    dtype: str = dataclasses.field(metadata=dict(static=True))


@typing.no_type_check  # JAX rebuilds pytrees from non-array leaves (ArgInfo, specs)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    """The paged KV cache: K and V of shape `[L * NB, BS, K, H]`; layer l's blocks start at
    `l * NB`, and the first of them is its null block. `quant`: the scales of an fp8 pool (None:
    the pool holds the values as computed)."""

    k: Float[Array, "LNB BS K H"]
    v: Float[Array, "LNB BS K H"]
    num_layers: int = dataclasses.field(metadata=dict(static=True))
    quant: KVQuant | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks of each layer (NB), its null block included."""
        return self.k.shape[0] // self.num_layers

    @property
    def block_size(self) -> int:
        return self.k.shape[1]


def init_kv_pool(config: ModelConfig, num_blocks: int, block_size: int, dtype, platform: str | None = None) -> KVPool:
    """A zeroed pool of `num_blocks` blocks (block 0 included) for every layer, stored in
    `kv_storage_dtype(dtype, platform)`; a float8 `dtype` gets scales of 1 (`KVQuant`)."""
    shape = (config.num_layers * num_blocks, block_size, config.num_kv_heads, config.head_dim)
    storage = kv_storage_dtype(dtype, platform)
    quant = None
    if is_fp8(jnp.dtype(dtype).name):
        scales = (config.num_layers, config.num_kv_heads)  # two arrays: the pool is donated
        quant = KVQuant(
            k_scale=jnp.ones(scales, jnp.float32), v_scale=jnp.ones(scales, jnp.float32), dtype=jnp.dtype(dtype).name
        )
    return KVPool(k=jnp.zeros(shape, storage), v=jnp.zeros(shape, storage), num_layers=config.num_layers, quant=quant)
