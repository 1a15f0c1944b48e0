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
    assert governor.speculate(8)  # nothing measured: speculation first
    governor.record(8, True, seconds=1.0, tokens=8)  # 8 tokens/s speculating
    assert not governor.speculate(8)  # then plain decoding
    governor.record(8, False, seconds=1.0, tokens=16)  # 16 tokens/s plain: it wins at 8
    decisions = [governor.speculate(8) for _ in range(8)]
    assert decisions.count(True) == 2 and decisions[1] is True  # every 4th step tries the other mode
    assert governor.speculate(1)  # another batch size is measured on its own
    governor.record(1, True, seconds=1.0, tokens=3)
    governor.record(1, False, seconds=1.0, tokens=1)
    assert [governor.speculate(1) for _ in range(3)] == [True, True, False]  # the 4th decision explores
    for _ in range(30):  # speculation at 8 gets better (acceptance rose): it takes over
        governor.record(8, True, seconds=1.0, tokens=40)
    assert sum(governor.speculate(8) for _ in range(8)) == 6


def test_adaptive_false_speculates_in_every_step_that_can():
    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
    governor = SpeculationGovernor(config.disable_by_batch_size, adaptive=config.adaptive)
    governor.record(4, True, seconds=1.0, tokens=1)
    governor.record(4, False, seconds=1.0, tokens=100)
    assert all(governor.speculate(4) for _ in range(40))
    with pytest.raises(SpeculativeConfigError, match="adaptive='no'"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "adaptive": "no"})
