"""The measured choice between two ways of running steps (`ModeGovernor`): the engine's
read-first choice while grammars run explores several steps at a time. (Speculation's use of it:
tests/test_speculation_governor.py.)"""

import pytest

from jaxpaged.core.mode_governor import READ_FIRST_EXPLORE_STEPS, ModeGovernor


def steps(governor: ModeGovernor, num_running: int, tokens_per_s: dict, n: int) -> list[bool]:
    """`n` steps as the engine runs them: choose, then record the chosen mode's figure."""
    chosen = []
    for _ in range(n):
        mode = governor.choose(num_running)
        governor.record(num_running, mode, seconds=1.0, tokens=tokens_per_s[mode])
        chosen.append(mode)
    return chosen


def test_the_other_mode_is_explored_for_explore_steps_and_the_faster_one_runs_between():
    governor = ModeGovernor(first=False, explore_every=4, window=1, settle_steps=1, explore_steps=5)
    fast_read_first = {True: 20, False: 10}
    # `first` first (its first step, after nothing, counted), then the other (its first step,
    # right after the switch, not counted), then the faster, True: 2x, for 4 * 2**2 = 16 steps,
    # then 5 steps of the other, and again
    assert (
        steps(governor, 64, fast_read_first, 3 + 16 + 5 + 16 + 5)
        == [False, True, True] + ([True] * 16 + [False] * 5) * 2
    )
    assert governor.rates() == {(64, False): 10.0, (64, True): 20.0}


def test_explore_steps_must_leave_a_counted_step():
    with pytest.raises(ValueError, match="explore_steps=1 must be at least 2"):
        ModeGovernor(explore_steps=1)
    assert READ_FIRST_EXPLORE_STEPS >= 2
