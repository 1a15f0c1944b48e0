"""Writing this step's K/V into the paged pools.

An XLA scatter, not a Pallas kernel: under donation XLA updates the pool buffers in place (the
scatter at (block, offset) aliases its operand), and it moves only T x K x H elements per pool,
which no custom kernel beats. A Pallas variant with `input_output_aliases` belongs beside this
one only if a profile ever says otherwise.
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
) -> tuple[Float[Array, "NB BS K H"], Float[Array, "NB BS K H"]]:
    """Scatters new K/V rows into the pools at `slot = block_id * BS + offset`.

    Args:
      k_pool, v_pool: one layer's pools; donate them to update in place.
      k_new, v_new: this step's keys and values, cast to the pool dtype.
      slot_mapping: pool slot of each new token; padding tokens write into block 0 (the null
        block), never at -1.

    Returns:
      The updated `(k_pool, v_pool)`.
    """
    return reference.write_kv(k_pool, v_pool, k_new, v_new, slot_mapping)
