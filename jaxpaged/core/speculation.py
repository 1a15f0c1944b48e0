"""Speculative decoding on the host: n-gram proposals and who may speculate (no JAX here).

A step verifies a sequence's k proposals as a (k + 1)-token query: its last token and the
proposals, each at its own position. The device samples a token at every one of those positions
exactly as a plain decode step would there (the same filtering, the same per-position random
key) and accepts the proposals up to the first that differs from its sample; the sequence gains
the accepted proposals and the sample after them. Each emitted token is therefore the token plain
decoding would have sampled in that context: greedy and seeded outputs are the same, token for
token, with and without speculation, and the output distribution is the target model's.

The K/V written at rejected positions lie past the sequence's length: attention never reads
past it, the next step overwrites them, and the blocks holding only such slots go back to the
pool (`BlockManager.trim`, which gives the sequence a new table list so the step packer rewrites
its copy). Prefix-cache blocks are registered from the sequence's own tokens only, so a rejected
proposal never reaches the cache.

Proposals are handed out after every decode has its own token, from the token budget and the
free blocks left: they never preempt a sequence or evict a cached block. (So is a draft model's
room: the k positions past a step's tokens where it writes the K/V of its proposing decode.)

Whether a step speculates at all is the `SpeculationGovernor`'s call: checking proposals costs
compute (k + 1 tokens per sequence instead of 1) and, with async scheduling, the overlap of host
and device (proposals follow the newest tokens, so the step waits for the previous one). At a
batch size where the device is compute-bound, or with proposals that are rarely accepted, that
costs more than the accepted tokens save; the governor measures both modes and keeps the faster.
With a draft model a speculating step also has the draft propose for the next step (see
`DraftModelProposer`); a step that does not speculate costs no draft work and may fuse decode
steps and overlap the host's work like any plain step.
"""

import collections

import numpy as np

from jaxpaged.config.speculative import SpeculativeConfig
from jaxpaged.sampling_params import SamplingParams

# Engine counters of speculative decoding (vLLM's metric names without `vllm:`): proposal
# windows checked, proposed tokens, accepted tokens; and per position (the j-th proposal kept).
SPEC_DECODE_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
SPEC_DECODE_PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


def is_constrained(params: SamplingParams) -> bool:
    """Whether a request's tokens are masked (structured outputs, allowed_token_ids, bad_words)."""
    return params.structured_outputs is not None or params.allowed_token_ids is not None or bool(params.bad_words)


def speculation_allowed(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a sequence may be given proposals now: not with penalties (they would have to see
    each proposal as generated before sampling the next position), nor before `min_tokens` (its
    banned tokens change within the window), nor when the request opted out. A constrained
    sequence may: its proposals are checked against its constraint first, and each position is
    sampled under the mask the constraint has after the proposals before it (see
    `jaxpaged.structured.constraint`)."""
    return (
        params.speculate
        and params.presence_penalty == 0
        and params.frequency_penalty == 0
        and params.repetition_penalty == 1
        and num_output_tokens >= params.min_tokens
    )


# How far back the lookup searches: the cost per sequence and step stays bounded (a few
# microseconds) however long the sequence grows.
NGRAM_LOOKBACK = 1024


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
    last n tokens (within its last `NGRAM_LOOKBACK` tokens), for n from `prompt_lookup_max`
    down to `prompt_lookup_min`."""

    needs_model = False

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.lookup = range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1)

    def propose(self, token_ids: list[int], limit: int) -> list[int]:
        """Up to `min(k, limit)` proposed next tokens for a sequence of `token_ids` (may be none)."""
        limit = min(self.k, limit)
        if limit <= 0:
            return []
        tokens = np.asarray(token_ids[-NGRAM_LOOKBACK:])  # the scheduler passes no more
        for n in self.lookup:
            if n >= len(tokens):
                continue
            # Windows starting before the suffix itself; the latest one equal to it.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return [int(t) for t in tokens[start : start + limit]]
        return []


class DraftModelProposer:
    """Proposals of a draft model, which runs on the device (`jaxpaged.worker.draft_runner`).

    They reach the scheduler the way n-gram proposals do, as tokens, one step later: a step
    scheduled with `propose` marks the entries the draft proposes for after it (`drafting`, with
    room in their block tables for the draft's k positions); the runner's output of that step
    carries the draft's k tokens after each one's new tokens, `Scheduler.postprocess` keeps
    them as the sequence's `spec_token_ids`, and the next `schedule()` checks them.
    """

    needs_model = True

    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens


class SpeculationGovernor:
    """Decides, step by step, whether decoding sequences get proposals.

    Off while more than `disable_by_batch_size` sequences run (vLLM's rule). Otherwise the mode
    that has delivered more output tokens per second of engine step (host and device, as the
    caller times `step()`) at this batch size (its power-of-two bucket) over the recent steps:
    acceptance and the cost of checking proposals are both in that figure. A mode not yet
    measured at a bucket is tried first; after that the other mode runs for two steps (the first
    after a switch is not counted, see `record`) once the better one has run
    `explore_every * r**2` steps, r being how many times faster the better one is (at most
    `max_explore_every` steps; `explore_every` until each mode's figure has `settle_steps` steps
    in it, so one noisy first step does not shut a mode out for long): a change (a new mix of requests, acceptance going up or down) is
    seen, and exploring a mode r times slower costs 2 (r - 1) / (explore_every r**2) of the time,
    at most 1 / (2 explore_every) (3% by default, at r = 2).

    Args:
      disable_by_batch_size: see `SpeculativeConfig`.
      adaptive: False: every step speculates (below `disable_by_batch_size`).
      explore_every: steps of the better mode between two runs of the other when both are as fast.
      max_explore_every: the most steps of the better mode between two runs of the other.
      window: how many recent steps of a mode its figure averages (exponentially).
      settle_steps: steps counted in both figures before the slower mode is explored less often.
    """

    def __init__(
        self,
        disable_by_batch_size: int | None = None,
        explore_every: int = 16,
        window: int = 8,
        adaptive: bool = True,
        max_explore_every: int = 256,
        settle_steps: int = 3,
    ):
        self.disable_by_batch_size = disable_by_batch_size
        self.adaptive = adaptive
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.settle_steps = settle_steps
        self.weight = 2 / (window + 1)
        self._rate: dict[tuple[int, bool], float] = {}  # (bucket, speculating) -> tokens per second
        self._counted: collections.Counter = collections.Counter()  # (bucket, speculating) -> steps in its rate
        self._since: collections.Counter = collections.Counter()  # bucket -> decisions since it last explored
        self._previous: bool | None = None  # the mode of the step recorded last

    @staticmethod
    def bucket(num_running: int) -> int:
        return 1 << max(0, num_running - 1).bit_length()

    def speculate(self, num_running: int) -> bool:
        """Whether this step, with `num_running` running sequences, should check proposals."""
        if self.disable_by_batch_size is not None and num_running > self.disable_by_batch_size:
            return False
        if not self.adaptive:
            return True
        b = self.bucket(num_running)
        plain, spec = self._rate.get((b, False)), self._rate.get((b, True))
        if spec is None or plain is None:
            return spec is None  # try what is not measured yet, speculation first
        best = spec >= plain
        ratio = max(spec, plain) / max(min(spec, plain), 1e-9)
        settled = min(self._counted[b, False], self._counted[b, True]) >= self.settle_steps
        interval = min(self.max_explore_every, round(self.explore_every * ratio**2)) if settled else self.explore_every
        self._since[b] += 1
        if self._since[b] <= interval:
            return best
        if self._since[b] >= interval + 2:  # the second step of the other mode: the next is the better's
            self._since[b] = 0
        return not best

    def record(self, num_running: int, speculated: bool, seconds: float, tokens: int) -> None:
        """One step's figure: `tokens` output tokens appended in `seconds` of `step()`. The first
        step of a mode after the other is not counted: with async scheduling a step reads the
        previous step's tokens, so its figure is the other mode's (or none)."""
        switched, self._previous = self._previous is not None and speculated != self._previous, speculated
        if seconds <= 0 or switched:
            return
        key = (self.bucket(num_running), speculated)
        rate = tokens / seconds
        old = self._rate.get(key)
        self._rate[key] = rate if old is None else old + self.weight * (rate - old)
        self._counted[key] += 1


def make_proposer(config: SpeculativeConfig | None) -> "NgramProposer | DraftModelProposer | None":
    """The scheduler's proposer for a `speculative_config` (None: speculation off)."""
    if config is None:
        return None
    return DraftModelProposer(config) if config.method == "draft_model" else NgramProposer(config)
