"""Step buckets as the throughput model sees them: a rule from a step's tokens and sequences to
the (T, S) shape its program was compiled for (no JAX here).

The engine's rule is its step packer's (`jaxpaged.worker.step_packer.StepPacker.bucket_for` and its
layouts' sequence counts): the caller hands it in (`jaxpaged.bench.throughput_model.engine_buckets`),
so the model follows the engine when the rule changes; this module sits below the worker and
cannot import it. `finer_buckets` is the finer-buckets lever on top of any rule; `powers_of_two` the
engine's buckets before their 3/4 points (the first H100 run's).
"""

import dataclasses
from collections.abc import Callable

# (num_tokens, num_seqs) -> (T, S)
BucketRule = Callable[[int, int], tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class Limits:
    """The limits a bucket rule is built for (the engine's step packer takes the same).

    Attributes:
      max_num_seqs: sequences per step at most.
      max_num_batched_tokens: tokens per step at most (the largest bucket covers it).
      max_model_len: longest sequence.
      block_size: tokens per KV block.
      vocab_size: the model's vocabulary.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    vocab_size: int


# Limits -> the engine's bucket rule for them.
BucketFactory = Callable[[Limits], BucketRule]

# The lever leaves buckets up to this many tokens as they are (decode steps of few sequences,
# small prefills: their programs are cheap, and more of them would cost compile time).
FINE_ABOVE = 256


def finer_buckets(rule: BucketRule, step: int, max_num_seqs: int) -> BucketRule:
    """`rule`, with token buckets above `FINE_ABOVE` tokens rounded up to a multiple of `step`
    instead (never larger than `rule`'s); the sequence bucket is min(T, max_num_seqs), as the
    engine's.

    Raises:
      ValueError: `step` is not positive.
    """
    if step < 1:
        raise ValueError(f"--token-bucket-step {step}: must be at least 1")

    def finer(num_tokens: int, num_seqs: int) -> tuple[int, int]:
        t, s = rule(num_tokens, num_seqs)
        if num_tokens <= FINE_ABOVE:
            return t, s
        fine = min(t, -(-num_tokens // step) * step)
        return fine, min(fine, max_num_seqs)

    return finer


def powers_of_two(rule: BucketRule, max_num_seqs: int) -> BucketRule:
    """`rule` with each token bucket rounded up to a power of two (the sequence bucket
    min(T, max_num_seqs), as the engine's)."""

    def powers(num_tokens: int, num_seqs: int) -> tuple[int, int]:
        t, s = rule(num_tokens, num_seqs)
        power = 1 << (t - 1).bit_length()
        return (t, s) if power == t else (power, min(power, max_num_seqs))

    return powers
