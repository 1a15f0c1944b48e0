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


def test_the_faster_mode_wins_at_each_batch_size_and_the_other_is_retried():
    governor = SpeculationGovernor(explore_every=4)

    def steps(num_running, tokens_per_s, n):
        """`n` steps as the engine runs them: decide, then record the decided mode's figure."""
        decisions = []
        for _ in range(n):
            speculated = governor.speculate(num_running)
            governor.record(num_running, speculated, seconds=1.0, tokens=tokens_per_s[speculated])
            decisions.append(speculated)
        return decisions

    # nothing measured: speculation first, then plain decoding (its first step, right after the
    # switch, is not counted), then the faster: plain, 16 tokens/s against 8; every 4 decisions
    # (the 4th and 5th of each 4) two steps of the other mode
    assert steps(8, {True: 8, False: 16}, 4) == [True, False, False, True]
    assert steps(8, {True: 8, False: 16}, 8) == [True, False, False, True, True, False, False, True]
    assert steps(1, {True: 3, False: 1}, 6) == [True, False, False, False, False, True]  # its own figures
    steps(8, {True: 40, False: 16}, 40)  # speculation at 8 gets better (acceptance rose): it takes over
    assert steps(8, {True: 40, False: 16}, 8) == [False, True, True, False, False, True, True, False]


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
