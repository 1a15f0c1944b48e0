"""A choice between two ways of running engine steps, made step by step from what each delivered.

The engine has two such choices: whether a step checks speculative proposals
(`jaxpaged.core.speculation.SpeculationGovernor`), and, while grammars constrain running
sequences, whether it reads the step in flight before scheduling the next (`LLMEngine`: the
matchers then know every token, so forced runs are scheduled whole and masks are filled before
dispatch) or overlaps the two (async scheduling: a run's first token is still pending, so each
run costs a step more). Which is faster depends on the batch, the model and the machine: on a
2-core CPU, where the host's work and the device's share the cores, reading first was 1.34x
faster at 64 JSON-constrained sequences and 0.88x at one (`benchmarks/results/README.md`).
"""

import collections

# Whether a step reads the one in flight first changes how many forced tokens the next few steps
# take, so that choice's figures settle over several steps: it explores 6 at a time (5 counted).
READ_FIRST_EXPLORE_STEPS = 6


class ModeGovernor:
    """Picks mode True or False for each step: the one that has delivered more output tokens per
    second of engine step (host and device, as the caller times it) at this batch size (its
    power-of-two bucket) over the recent steps.

    A mode not yet measured at a bucket is tried first (`first` before the other); after that the
    other mode runs for `explore_steps` steps (the first after a switch is not counted, see
    `record`) once
    the better one has run `explore_every * r**2` steps, r being how many times faster the
    better one is (at most `max_explore_every` steps; `explore_every` until each mode's figure
    has `settle_steps` steps in it, so one noisy first step does not shut a mode out for long):
    a change (a new mix of requests) is seen, and exploring a mode r times slower costs
    E (r - 1) / (explore_every r**2) of the time for E `explore_steps`, at most
    E / (4 explore_every) (3% with the defaults, at r = 2).

    Args:
      first: the mode tried first at a new bucket.
      explore_steps: steps the other mode runs each time it is explored (at least 2: the first
        is not counted). More where a mode's figure settles over several steps.
      explore_every: steps of the better mode between two runs of the other when both are as fast.
      max_explore_every: the most steps of the better mode between two runs of the other.
      window: how many recent steps of a mode its figure averages (exponentially).
      settle_steps: steps counted in both figures before the slower mode is explored less often.
    """

    def __init__(
        self,
        first: bool = True,
        explore_every: int = 16,
        window: int = 8,
        max_explore_every: int = 256,
        settle_steps: int = 3,
        explore_steps: int = 2,
    ):
        if explore_steps < 2:
            raise ValueError(f"explore_steps={explore_steps} must be at least 2 (the first step is not counted)")
        self.first = first
        self.explore_steps = explore_steps
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.settle_steps = settle_steps
        self.weight = 2 / (window + 1)
        self._rate: dict[tuple[int, bool], float] = {}  # (bucket, mode) -> tokens per second
        self._counted: collections.Counter = collections.Counter()  # (bucket, mode) -> steps in its rate
        self._since: collections.Counter = collections.Counter()  # bucket -> decisions since it last explored
        self._previous: bool | None = None  # the mode of the step recorded last

    @staticmethod
    def bucket(num_running: int) -> int:
        return 1 << max(0, num_running - 1).bit_length()

    def choose(self, num_running: int) -> bool:
        """The mode of this step, with `num_running` running sequences."""
        b = self.bucket(num_running)
        rate_first, rate_other = self._rate.get((b, self.first)), self._rate.get((b, not self.first))
        if rate_first is None or rate_other is None:
            return self.first if rate_first is None else not self.first  # what is not measured yet
        best = self.first if rate_first >= rate_other else not self.first
        ratio = max(rate_first, rate_other) / max(min(rate_first, rate_other), 1e-9)
        settled = min(self._counted[b, False], self._counted[b, True]) >= self.settle_steps
        interval = min(self.max_explore_every, round(self.explore_every * ratio**2)) if settled else self.explore_every
        self._since[b] += 1
        if self._since[b] <= interval:
            return best
        if self._since[b] >= interval + self.explore_steps:  # the other mode's last step: then the better's
            self._since[b] = 0
        return not best

    def record(self, num_running: int, mode: bool, seconds: float, tokens: int) -> None:
        """One step's figure: `tokens` output tokens appended in `seconds` of `step()`. The first
        step of a mode after the other is not counted: with async scheduling a step reads the
        previous step's tokens, so its figure is the other mode's (or none)."""
        switched, self._previous = self._previous is not None and mode != self._previous, mode
        if seconds <= 0 or switched:
            return
        key = (self.bucket(num_running), mode)
        rate = tokens / seconds
        old = self._rate.get(key)
        self._rate[key] = rate if old is None else old + self.weight * (rate - old)
        self._counted[key] += 1

    def rates(self) -> dict[tuple[int, bool], float]:
        """Each measured `(bucket, mode)`'s figure: output tokens per second of step."""
        return dict(self._rate)
