"""Prompt logprobs on the device: for each token of a step, the log-probability and rank of the
token that follows it in the prompt, and the top-L alternatives (vLLM's `prompt_logprobs`).

Dimension letters: T tokens in the step, D model width, V vocabulary, L = MAX_LOGPROBS,
C tokens per chunk.

The `[T, V]` logits never leave the device, and never exist whole on it either: tokens are
taken C at a time (`lax.map`), so the largest temporary is `[C, V]` float32, the size of the
logits a sampler already sees for C rows. Only `[T, 2 + 2L]` int32 comes back.
"""

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxpaged.model.sampler import MAX_LOGPROBS

# Tokens whose logits are computed at once (bounds the `[C, V]` temporary).
PROMPT_LOGPROBS_CHUNK = 256


def prompt_logprobs(
    hidden: Float[Array, "T D"],
    compute_logits: Callable[[Float[Array, "C D"]], Float[Array, "C V"]],
    targets: Int[Array, " T"],
    chunk: int = PROMPT_LOGPROBS_CHUNK,
) -> Int[Array, "T W"]:
    """Each token's next-token log-probabilities, packed as int32 (floats bit-cast).

    Args:
      hidden: the final hidden states of every token of the step.
      compute_logits: the model's LM head (float32 logits).
      targets: the prompt token after each token (any id for tokens nobody asked about: their
        rows are computed and ignored).
      chunk: tokens per chunk at most (a power of two; the chunk is the largest power of two
        dividing T up to it: T = 384 runs in chunks of 128).

    Returns:
      `[T, 2 + 2L]`: per token the target's logprob (bit-cast), its rank (1 = likeliest),
      the top-L ids, then their logprobs (bit-cast). See `unpack_prompt_logprobs`.
    """
    num_tokens = hidden.shape[0]
    c = math.gcd(chunk, num_tokens)

    def one(args):
        h, t = args
        logprobs = jax.nn.log_softmax(compute_logits(h), axis=-1)  # [C, V]
        chosen = jnp.take_along_axis(logprobs, t[:, None], axis=-1)[:, 0]
        ranks = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, MAX_LOGPROBS)
        bits = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)  # noqa: E731
        return jnp.concatenate(
            [bits(chosen)[:, None], ranks[:, None].astype(jnp.int32), top_ids.astype(jnp.int32), bits(top_logprobs)],
            axis=1,
        )

    out = jax.lax.map(one, (hidden.reshape(-1, c, hidden.shape[-1]), targets.reshape(-1, c)))
    return out.reshape(num_tokens, 2 + 2 * MAX_LOGPROBS)


def unpack_prompt_logprobs(packed):
    """The host side of `prompt_logprobs` (numpy `[T, 2 + 2L]` int32): logprobs `[T]`, ranks `[T]`,
    top_ids `[T, L]`, top_logprobs `[T, L]`."""
    top = MAX_LOGPROBS
    floats = lambda x: np.ascontiguousarray(x).view(np.float32)  # noqa: E731
    return floats(packed[:, 0]), packed[:, 1], packed[:, 2 : 2 + top], floats(packed[:, 2 + top : 2 + 2 * top])
