"""Token sampling on device: penalties, temperature, top-k / top-p / min-p, seeds and logprobs.

Dimension letters: S sequences (padded), V vocabulary, R slots of the penalty tables,
T tokens in the step, L = MAX_LOGPROBS, LB logit-bias entries per row, W = ceil(V / 32) words of a
packed token mask.

Every sequence carries its own seed; its key for a token is `fold_in(fold_in(key(seed),
index), position)`, so a seeded request yields the same tokens whatever shares its batch.
Penalties read per-slot tables kept on device between steps (see `update_penalty_tables`):
`prompt_mask[R, V]` marks tokens seen in the prompt, `output_counts[R, V]` counts generated
tokens.

No branch depends on a device value: on a GPU, XLA runs a `lax.cond` by copying its predicate to
the host and waiting for the stream, a host sync inside the step. What every batch needs
(temperature, min-p, penalties, banned ids, logit bias) is computed branch-free (neutral parameters leave the
logits exactly as they are); the two expensive paths, sorting for top-k / top-p and the top-L
logprobs search, are static `SamplerOptions` that the runner picks per step from its requests
(one compiled sampler per option set and row bucket: `ENGINE_SAMPLER_OPTIONS`). So is the token
mask (structured outputs, `allowed_token_ids`, `bad_words`): packed bits `[S, W]` computed on
the host, applied before everything else; a step without a constrained row carries none.
"""

import dataclasses
import typing

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from jaxpaged.config.defaults import MAX_LOGPROBS  # L: the top logprobs per token


class SamplerOptions(typing.NamedTuple):
    """The sampler's static paths (a jit static argument: one program per combination).

    Attributes:
      filter: top-k / top-p filtering (a sort over the vocabulary); off when no row filters.
      logprobs: the top-L alternatives and the sampled token's rank; off when no row asks.
      mask: a packed token mask `[S, W]` (bit `i % 32` of word `i // 32` allows token i); off
        when no row is constrained.
    """

    filter: bool = False
    logprobs: bool = False
    mask: bool = False

    def describe(self) -> str:
        return "+".join(name for name, on in zip(self._fields, self) if on) or "plain"


# The option sets an engine compiles: plain, and both paths at once (a batch that needs either
# takes both: two samplers to compile per row count instead of four, at the cost of a top-L
# search when only filtering was needed, or a sort when only logprobs were).
# Each with and without a token mask (constrained rows): four samplers per row count.
ENGINE_SAMPLER_OPTIONS = tuple(
    SamplerOptions(filter=full, logprobs=full, mask=mask) for mask in (False, True) for full in (False, True)
)


@typing.no_type_check  # JAX rebuilds pytrees from non-array leaves (ArgInfo, specs)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingTensors:
    """Per-sequence sampling parameters, padded to S rows.

    Attributes:
      temperature: `[S]` 0 means greedy.
      top_k: `[S]` 0 means off.
      top_p: `[S]` 1 means off.
      min_p: `[S]` 0 means off.
      presence_penalty, frequency_penalty: `[S]` applied to generated tokens (0 = off).
      repetition_penalty: `[S]` applied to prompt and generated tokens (1 = off).
      seed: `[S]` per-request seed.
      index: `[S]` completion index within its request (n > 1 samples differ).
      position: `[S]` absolute position of the token being sampled.
      slot: `[S]` row of the penalty tables owned by the sequence.
      ban_until: `[S]` the row's banned ids apply while `position < ban_until` (the prompt's
        length plus min_tokens; 0: never).
    """

    temperature: Float[Array, " S"]
    top_k: Int[Array, " S"]
    top_p: Float[Array, " S"]
    min_p: Float[Array, " S"]
    presence_penalty: Float[Array, " S"]
    frequency_penalty: Float[Array, " S"]
    repetition_penalty: Float[Array, " S"]
    seed: Int[Array, " S"]
    index: Int[Array, " S"]
    position: Int[Array, " S"]
    slot: Int[Array, " S"]
    ban_until: Int[Array, " S"]


@typing.no_type_check  # JAX rebuilds pytrees from non-array leaves (ArgInfo, specs)
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SampleResult:
    """Sampled tokens and their log-probabilities (from the raw logits, as vLLM reports them).

    Attributes:
      token_ids: `[S]` sampled token per sequence.
      logprobs: `[S]` log-probability of the sampled token.
      ranks: `[S]` its rank among all tokens, 1 = likeliest (0 without the logprobs option).
      top_ids, top_logprobs: `[S, L]` the L likeliest tokens (L = 0 without the logprobs option).
      num_accepted: with speculative decoding, `[S']` proposals each sequence keeps (the rows
        are then R per sequence: S = S' * R); None otherwise.
    """

    token_ids: Int[Array, " S"]
    logprobs: Float[Array, " S"]
    ranks: Int[Array, " S"]
    top_ids: Int[Array, "S L"]
    top_logprobs: Float[Array, "S L"]
    num_accepted: Int[Array, " S2"] | None = None


def update_penalty_tables(
    prompt_mask: Bool[Array, "R V"],
    output_counts: Int[Array, "R V"],
    token_ids: Int[Array, " T"],
    token_slot: Int[Array, " T"],
    token_is_output: Bool[Array, " T"],
    reset_slots: Int[Array, " S"],
) -> tuple[Bool[Array, "R V"], Int[Array, "R V"]]:
    """Records this step's input tokens in the penalty tables.

    Rows in `reset_slots` (sequences starting from scratch: new, or recomputed after
    preemption) are cleared first. Padding uses the out-of-range row R, which is dropped.
    A token sampled at step N is an input at step N + 1, so it is counted before sampling there.
    """
    rows = prompt_mask.shape[0]
    prompt_mask = prompt_mask.at[reset_slots].set(False, mode="drop")
    output_counts = output_counts.at[reset_slots].set(0, mode="drop")
    prompt_rows = jnp.where(token_is_output, rows, token_slot)
    output_rows = jnp.where(token_is_output, token_slot, rows)
    prompt_mask = prompt_mask.at[prompt_rows, token_ids].set(True, mode="drop")
    output_counts = output_counts.at[output_rows, token_ids].add(1, mode="drop")
    return prompt_mask, output_counts


def _apply_penalties(logits, params: SamplingTensors, prompt_mask, output_counts):
    slots = jnp.minimum(params.slot, prompt_mask.shape[0] - 1)
    counts = output_counts[slots].astype(jnp.float32)  # [S, V]
    seen = prompt_mask[slots] | (counts > 0)
    rep = params.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - params.frequency_penalty[:, None] * counts
    return logits - params.presence_penalty[:, None] * (counts > 0)


def _top_k_top_p(logits, top_k, top_p):
    """Masks tokens outside each row's top-k and top-p nucleus (ties at the edge are kept)."""
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
    # top-p applies to the top-k distribution, renormalised (as vLLM does).
    in_top_k = jnp.arange(vocab)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    # The nucleus: the smallest prefix whose mass reaches top_p (its last token included).
    # (top_p 1 keeps every token exactly: a cumulative sum may reach 1 early by rounding)
    # The top token is always in it, whatever top_p rounded to.
    in_nucleus = ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1) | (jnp.arange(vocab) == 0)) & in_top_k
    pth = jnp.min(jnp.where(in_nucleus, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((logits < kth) | (logits < pth), -jnp.inf, logits)


def _sample_filtered(logits, params: SamplingTensors, top_k_top_p: bool):
    """Tempered sampling after top-k / top-p (with `top_k_top_p`) and min-p filtering (Gumbel-max
    with per-row keys)."""
    scaled = logits / jnp.where(params.temperature > 0, params.temperature, 1.0)[:, None]
    filtered = _top_k_top_p(scaled, params.top_k, params.top_p) if top_k_top_p else scaled
    max_logit = jnp.max(filtered, axis=-1, keepdims=True)
    # min_p: keep tokens whose probability is at least min_p times the top token's.
    min_logit = jnp.where(params.min_p > 0, jnp.log(jnp.maximum(params.min_p, 1e-30)), -jnp.inf)
    filtered = jnp.where(filtered < max_logit + min_logit[:, None], -jnp.inf, filtered)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, logits.shape[-1:], jnp.float32))(_keys(params))
    return jnp.argmax(filtered + gumbel, axis=-1).astype(jnp.int32)


def _keys(params: SamplingTensors):
    def one(seed, index, position):
        key = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), index)
        return jax.random.fold_in(key, position)

    return jax.vmap(one)(params.seed, params.index, params.position)


def sample(
    logits: Float[Array, "S V"],
    params: SamplingTensors,
    prompt_mask: Bool[Array, "R V"],
    output_counts: Int[Array, "R V"],
    banned_ids: Int[Array, "S B"],
    options: SamplerOptions = SamplerOptions(),
    token_mask: Int[Array, "S W"] | None = None,
    logit_bias: tuple[Int[Array, "S LB"], Float[Array, "S LB"]] | None = None,
) -> SampleResult:
    """Samples one token per row of float32 logits, with no branch on a device value.

    Args:
      logits: raw model logits.
      params: per-row sampling parameters.
      prompt_mask, output_counts: the penalty tables (already holding this step's inputs).
      banned_ids: token ids each row may not sample while `position < ban_until` (padding: V).
      options: the static paths: top-k / top-p filtering (rows with top_k 0 and top_p 1 are
        left as they are by it), the top-L logprobs, the token mask. Static: pass it as a jit
        static argument.
      token_mask: with `options.mask`, the tokens each row may sample, packed (all ones:
        unconstrained). Sampling renormalises over them; reported logprobs stay the raw ones.
      logit_bias: `(ids, values)` added to each row's logits before penalties and sampling
        (OpenAI's `logit_bias`; padding ids V are dropped); the reported logprobs stay raw.
    """
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    if logit_bias is not None:
        bias_ids, bias_values = logit_bias
        logits = logits.at[jnp.arange(logits.shape[0])[:, None], bias_ids].add(bias_values, mode="drop")
    if options.mask:
        logits = apply_token_mask(logits, token_mask)
    banned = jnp.where((params.position < params.ban_until)[:, None], banned_ids, logits.shape[-1])
    logits = logits.at[jnp.arange(logits.shape[0])[:, None], banned].set(-jnp.inf, mode="drop")
    logits = _apply_penalties(logits, params, prompt_mask, output_counts)  # neutral rows: unchanged
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled_ids = _sample_filtered(logits, params, options.filter)
    token_ids = jnp.where(params.temperature > 0, sampled_ids, greedy_ids)
    chosen = jnp.take_along_axis(raw_logprobs, token_ids[:, None], axis=-1)[:, 0]
    rows = logits.shape[0]
    if options.logprobs:
        top_logprobs, top_ids = jax.lax.top_k(raw_logprobs, MAX_LOGPROBS)
        ranks = 1 + jnp.sum(raw_logprobs > chosen[:, None], axis=-1)
        top_ids, ranks = top_ids.astype(jnp.int32), ranks.astype(jnp.int32)
    else:
        top_logprobs, top_ids = jnp.zeros((rows, 0), raw_logprobs.dtype), jnp.zeros((rows, 0), jnp.int32)
        ranks = jnp.zeros((rows,), jnp.int32)
    return SampleResult(token_ids=token_ids, logprobs=chosen, ranks=ranks, top_ids=top_ids, top_logprobs=top_logprobs)


def apply_token_mask(logits: Float[Array, "S V"], token_mask: Int[Array, "S W"]) -> Float[Array, "S V"]:
    """Sets the logits of tokens whose bit is clear to -inf (bits past V are ignored)."""
    vocab = logits.shape[-1]
    bits = (token_mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(token_mask.shape[0], -1)[:, :vocab] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def pack_result(result: SampleResult) -> Int[Array, " N"]:
    """One int32 vector of a step's results (floats bit-cast), so they come back in one copy:
    token_ids, logprobs, ranks, top_ids, top_logprobs (each flattened), then num_accepted."""
    parts = [
        result.token_ids,
        _bits(result.logprobs),
        result.ranks,
        result.top_ids.ravel(),
        _bits(result.top_logprobs).ravel(),
    ]
    if result.num_accepted is not None:
        parts.append(result.num_accepted)
    return jnp.concatenate([p.astype(jnp.int32) for p in parts])


def _bits(x):
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
