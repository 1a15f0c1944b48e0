"""Writing this step's K/V into the paged pools, optionally quantised to float8.

An XLA scatter, not a Pallas kernel: under donation XLA updates the pool buffers in place (the
scatter at (block, offset) aliases its operand), and it moves only T x K x H elements per pool,
which no custom kernel beats; quantising (a divide, a clip and a cast) fuses into it. A Pallas
variant with `input_output_aliases` belongs beside this one only if a profile ever says otherwise.
`tests/test_kernels.py` checks the in-place update with `compiled.memory_analysis()`.

Dimension letters as in `pallas_kernels.reference`.
"""

from jaxtyping import Array, Float, Int

from pallas_kernels import reference


def write_kv(
    k_pool: Float[Array, "NB BS K H"],
    v_pool: Float[Array, "NB BS K H"],
    k_new: Float[Array, "T K H"],
    v_new: Float[Array, "T K H"],
    slot_mapping: Int[Array, " T"],
    *,
    k_scale: Float[Array, " K"] | None = None,
    v_scale: Float[Array, " K"] | None = None,
    quant_dtype=None,
) -> tuple[Float[Array, "NB BS K H"], Float[Array, "NB BS K H"]]:
    """Scatters new K/V rows into the pools at `slot = block_id * BS + offset`.

    Args:
      k_pool, v_pool: one layer's pools; donate them to update in place.
      k_new, v_new: this step's keys and values.
      slot_mapping: pool slot of each new token; padding tokens write into block 0 (the null
        block), never at -1.
      k_scale, v_scale: `[K]` float32 dequantisation scale per kv head (None: 1); only with
        `quant_dtype`.
      quant_dtype: None: rows are cast to the pool dtype. float8_e4m3fn or float8_e5m2: row x of
        kv head h is stored as `x / scale[h]` in float32, saturated to the float8 range (never
        NaN or inf) and rounded to float8, then cast to the pool's storage dtype (that float8
        dtype, or float32 on CPU, see `jaxpaged.model.kv_pool`: the values are float8's either
        way).

    Returns:
      The updated `(k_pool, v_pool)`.

    Raises:
      ValueError: scales without a `quant_dtype`, or a `quant_dtype` that is not float8.
    """
    return reference.write_kv(
        k_pool, v_pool, k_new, v_new, slot_mapping, k_scale=k_scale, v_scale=v_scale, quant_dtype=quant_dtype
    )
