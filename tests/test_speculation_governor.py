"""The rule that turns speculative decoding off for a step when it costs more than it saves."""

import pytest

from jaxpaged.config.speculative import SpeculativeConfig, SpeculativeConfigError
from jaxpaged.core.speculation import SpeculationGovernor


def test_disable_by_batch_size_is_vllms_option():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8})
    assert config.disable_by_batch_size == 8
    with pytest.raises(SpeculativeConfigError, match="disable_by_batch_size=0"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0})
    governor = SpeculationGovernor(disable_by_batch_size=8)
    assert governor.speculate(8) and not governor.speculate(9)


def decide_and_record(governor: SpeculationGovernor, num_running: int, tokens_per_s: dict, n: int) -> list[bool]:
    """`n` steps as the engine runs them: decide, then record the decided mode's figure."""
    decisions = []
    for _ in range(n):
        speculated = governor.speculate(num_running)
        governor.record(num_running, speculated, seconds=1.0, tokens=tokens_per_s[speculated])
        decisions.append(speculated)
    return decisions


def test_the_faster_mode_wins_at_each_batch_size_and_the_other_is_retried_less_the_slower_it_is():
    governor = SpeculationGovernor(
        explore_every=4, max_explore_every=40, window=1, settle_steps=1
    )  # the last step counts

    def steps(num_running, tokens_per_s, n):
        return decide_and_record(governor, num_running, tokens_per_s, n)

    # nothing measured: speculation first, then plain decoding (its first step, right after the
    # switch, is not counted), then the faster: plain, 2x faster, for 4 * 2**2 = 16 steps, then
    # two steps of speculation, and again
    slow_spec = {True: 8, False: 16}
    assert steps(8, slow_spec, 3 + 16 + 2 + 16 + 2) == [True, False, False] + ([False] * 16 + [True, True]) * 2
    assert steps(1, {True: 3, False: 1}, 3) == [True, False, False]  # its own figures
    assert steps(1, {True: 3, False: 1}, 36) == [True] * 36  # speculation 3x faster: 4 * 9 = 36 steps
    assert steps(1, {True: 3, False: 1}, 3) == [False, False, True]
    # at a mode 4x slower the interval stops at max_explore_every (not 4 * 16 = 64)
    assert steps(2, {True: 4, False: 16}, 3 + 40 + 2) == [True, False, False] + [False] * 40 + [True, True]
    # speculation at 8 gets better (acceptance rose): the next exploration sees it, and it takes over
    assert steps(8, {True: 40, False: 16}, 16 + 2 + 6) == [False] * 16 + [True] * 8


def test_until_both_figures_hold_a_window_of_steps_the_other_mode_is_retried_often():
    """One slow first step (a cold cache, a drained pipeline) must not shut a mode out for long."""
    governor = SpeculationGovernor(explore_every=4, settle_steps=3)
    slow_spec = {True: 8, False: 16}
    # each exploration counts one step of speculation: 2 more make its 3
    assert decide_and_record(governor, 8, slow_spec, 3 + 6 * 2) == [True, False, False] + ([False] * 4 + [True] * 2) * 2
    assert decide_and_record(governor, 8, slow_spec, 16 + 2) == [False] * 16 + [True] * 2


def test_the_first_step_after_a_switch_is_not_counted():
    """With async scheduling a step reads the previous step's tokens: the first step of a mode
    after the other carries the other's figure (or none), so it is not counted."""
    governor = SpeculationGovernor()
    governor.record(4, True, seconds=1.0, tokens=10)
    governor.record(4, False, seconds=1.0, tokens=0)  # reads nothing: the step before finished itself
    governor.record(4, False, seconds=1.0, tokens=30)
    assert governor._rate == {(4, True): 10.0, (4, False): 30.0}


def test_adaptive_false_speculates_in_every_step_that_can():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
    governor = SpeculationGovernor(config.disable_by_batch_size, adaptive=config.adaptive)
    governor.record(4, True, seconds=1.0, tokens=1)
    governor.record(4, False, seconds=1.0, tokens=100)
    assert all(governor.speculate(4) for _ in range(40))
    with pytest.raises(SpeculativeConfigError, match="adaptive='no'"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "no"})
