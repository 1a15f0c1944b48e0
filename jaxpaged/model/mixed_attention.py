"""Attention of a mixed step (decode tokens beside prefill chunks) on both kernels at once.

The scheduler puts a step's decoding sequences first (jaxpaged.core.scheduler: decodes, then
prefill chunks, then new prompts), so a mixed step's leading D sequences have one query token
each, and token i is sequence i's for i < D. Those rows go to the decode kernel, which reads
their context page by page with split-K, and the rest to the ragged kernel, which sees the
leading sequences as empty (no work items: `cu_q_lens` raised to D). On the first H100 run a
decode row in the ragged kernel cost 1.9-2.8x what it costs in the decode kernel.

D is counted on the device from `cu_q_lens` (the leading run of one-token sequences), so there is
no conditional and no new program: any one-token sequence at the front is served by the decode
kernel (a one-token prefill chunk is the same computation: one query over its whole context),
and a step whose front is not one-token sequences (a decode with speculative proposals, a
micro-batch cut out of a step) has D = 0 and runs on the ragged kernel alone. Each kernel leaves
the other's rows zero (the decode kernel's rows of length 0, the ragged kernel's rows of no
sequence), so the two outputs add exactly.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.model.metadata import AttentionMetadata


def leading_decode_rows(cu_q_lens: Int[Array, " S1"], num_seqs: Int[Array, ""]) -> Int[Array, ""]:
    """D: how many sequences at the front of the step have exactly one query token."""
    slots = cu_q_lens.shape[0] - 1
    one_token = ((cu_q_lens[1:] - cu_q_lens[:-1]) == 1) & (jnp.arange(slots) < num_seqs)
    return jnp.sum(jnp.cumprod(one_token.astype(jnp.int32)))


def mixed_paged_attention(
    ops,
    q: Float[Array, "T N H"],
    k_pool: Float[Array, "NB BS K H"],
    v_pool: Float[Array, "NB BS K H"],
    meta: AttentionMetadata,
    k_scale: Float[Array, " K"] | None = None,
    v_scale: Float[Array, " K"] | None = None,
    scale: float | None = None,
    window: int | Int[Array, ""] | None = None,
) -> Float[Array, "T N H"]:
    """`ops.ragged_paged_attention` of the step, its leading one-token sequences computed by
    `ops.paged_decode_attention` instead (same results; see the module docstring).

    Args:
      ops: the implementation (an `attention.AttentionBackend`, or `pallas_kernels` or its
        `reference` module: the same two functions).
      k_scale, v_scale: scales of an fp8 pool (None: 1).
      scale, window: the softmax scale and sliding window, as the kernels take them.
    """
    num_tokens, num_slots = q.shape[0], meta.kv_lens.shape[0]
    decodes = leading_decode_rows(meta.cu_q_lens, meta.num_seqs)
    rows = min(num_tokens, num_slots)  # decode row i is token i (a micro-batch may hold fewer tokens)
    is_decode = jnp.arange(rows) < decodes
    decode_out = ops.paged_decode_attention(
        q[:rows],
        k_pool,
        v_pool,
        meta.block_tables[:rows],
        jnp.where(is_decode, meta.kv_lens[:rows], 0),  # the other rows come back as zeros
        k_scale=k_scale,
        v_scale=v_scale,
        scale=scale,
        window=window,
    )
    rest = ops.ragged_paged_attention(
        q,
        k_pool,
        v_pool,
        jnp.maximum(meta.cu_q_lens, decodes).astype(meta.cu_q_lens.dtype),  # the decodes: empty here
        meta.kv_lens,
        meta.block_tables,
        meta.num_seqs,
        k_scale=k_scale,
        v_scale=v_scale,
        scale=scale,
        window=window,
    )
    return rest + jnp.pad(decode_out.astype(rest.dtype), ((0, num_tokens - rows), (0, 0), (0, 0)))
