"""Paged attention's implementations (`attention_backend`), one registry entry each.

A backend is the two attention functions with the references' signatures and results
(`pallas_kernels.reference`): `paged_decode_attention` (one query token per sequence) and
`ragged_paged_attention` (any mix), and how a mixed step uses them. "reference" is the jnp
references; "pallas" the Pallas Triton kernels (interpret mode off a GPU), whose mixed steps
put their leading decode rows on the decode kernel (`mixed_attention.py`) and whose mixture of
experts multiplies through the grouped-matmul kernel. A new kernel is one `AttentionBackend`
registered here and its name in `jaxpaged.config.attention.ATTENTION_BACKENDS` (the option's
choices, read without JAX); `tests/test_kernels.py` holds the two lists equal.
"""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

import pallas_kernels
from jaxpaged.config.attention import ATTENTION_BACKENDS
from jaxpaged.model.metadata import AttentionMetadata
from jaxpaged.model.mixed_attention import mixed_paged_attention
from pallas_kernels import reference


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """One implementation of paged attention.

    Attributes:
      name: the `attention_backend` value.
      paged_decode_attention: `pallas_kernels.reference.paged_decode_attention`'s signature.
      ragged_paged_attention: `pallas_kernels.reference.ragged_paged_attention`'s signature.
      mixed_decodes: a mixed step's leading one-token sequences go to the decode function
        (`mixed_paged_attention`); False: the ragged function serves the whole step (the jnp
        reference's decode would gather every row's whole block table).
      kernels: the model's other Pallas kernels run too (the mixture of experts' grouped matmul).
    """

    name: str
    paged_decode_attention: Callable
    ragged_paged_attention: Callable
    mixed_decodes: bool
    kernels: bool


BACKENDS: dict[str, AttentionBackend] = {}


def register_backend(backend: AttentionBackend) -> None:
    """Adds an implementation under its name (which `ATTENTION_BACKENDS` must list)."""
    BACKENDS[backend.name] = backend


register_backend(
    AttentionBackend("reference", reference.paged_decode_attention, reference.ragged_paged_attention, False, False)
)
register_backend(
    AttentionBackend("pallas", pallas_kernels.paged_decode_attention, pallas_kernels.ragged_paged_attention, True, True)
)


def resolve_attention_backend(name: str) -> str:
    """ "auto" is the Pallas kernels on a GPU and the jnp reference elsewhere; "pallas" on a
    CPU runs the kernels in interpret mode (slow; for tests)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not one of {ATTENTION_BACKENDS}")
    if name == "auto":
        return "pallas" if pallas_kernels.target_platform() == "gpu" else "reference"
    return name


def paged_attention(
    backend: AttentionBackend,
    q: Float[Array, "T N H"],
    k_pool: Float[Array, "NB BS K H"],
    v_pool: Float[Array, "NB BS K H"],
    meta: AttentionMetadata,
    k_scale: Float[Array, " K"] | None = None,
    v_scale: Float[Array, " K"] | None = None,
    *,
    scale: float,
    window: int | Int[Array, ""] | None,
) -> Float[Array, "T N H"]:
    """Attention of this step's queries over the pool (over whichever heads it is given: all of
    them, or one device's share under `shard_map`): the decode kernel for a decode program
    (`meta.decode_only`); else the ragged one, which serves any batch, with the step's leading
    decode rows on the decode kernel (`mixed_paged_attention`; the Pallas kernels only: the jnp
    reference's decode would gather every row's whole block table).

    There is no `lax.cond` choosing between them per step: a GPU conditional waits for its
    predicate on the host, and on CPU one over the pools copied every pool whose device holds a
    single kv head (XLA gave the operand another layout). The runner picks the program instead.

    Args:
      backend: the implementation (`BACKENDS`).
      k_scale, v_scale: scales of an fp8 pool, dequantized inside the kernels (None: 1).
      scale: the softmax scale (`ModelConfig.softmax_scale`).
      window: the layer's sliding window (a Python or traced int), or None.
    """
    kw = dict(k_scale=k_scale, v_scale=v_scale, scale=scale, window=window)
    if meta.decode_only:  # token i is sequence i's only query: decode attention, padded to T rows
        num_seqs = meta.kv_lens.shape[0]
        out = backend.paged_decode_attention(q[:num_seqs], k_pool, v_pool, meta.block_tables, meta.kv_lens, **kw)
        return jnp.pad(out, ((0, q.shape[0] - num_seqs), (0, 0), (0, 0)))
    if backend.mixed_decodes:
        return mixed_paged_attention(backend, q, k_pool, v_pool, meta, **kw)
    return backend.ragged_paged_attention(
        q, k_pool, v_pool, meta.cu_q_lens, meta.kv_lens, meta.block_tables, meta.num_seqs, **kw
    )
