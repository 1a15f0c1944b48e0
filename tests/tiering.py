"""Applies the test tiers (the table is tests/tiers.py) and cuts the slow tier into shards.

Options (conftest.py registers them):
    --tier pr      the default: the tier every CI run and every `pytest` runs
    --tier slow    the slow tier
    --tier all     both (`.ci/full`)
    --shard K      with --tier slow or all: only shard K (0 <= K < SHARDS) of the slow tier;
                   `auto` takes the checkout's commit count modulo SHARDS, so each new commit
                   runs the next shard (what `.ci/run` does)

Shards are balanced by the measured seconds in tests/durations.json: the slow tests of a module
stay together (one build of its module fixtures) unless they take more than a shard's share,
then a test function's, then single tests; the largest go first, each to the lightest shard so
far. A slow test the table has no time for is placed by a hash of its id, so adding one moves no
other test. The terminal summary gives each tier's test count and seconds.

Regenerate the durations after changing the tiers or the suite (junit files of a full run; a
test that runs in two CI stages, as the kernel tests do, counts both):
    python tests/tiering.py durations stage1.xml stage2.xml stage3.xml
"""

import datetime
import json
import os
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiers import SHARDS, TIERS  # noqa: E402

DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_SECONDS = 5.0  # what a test absent from the durations table is taken to cost
_COLLECTED = pytest.StashKey[list]()  # every collected node id, before tier selection
_SELECTED = pytest.StashKey[dict]()  # node id -> "pr" or "slow shard K" for the tests that run


def tier_of(nodeid: str) -> str:
    """ "pr" or "slow": the tier of the longest TIERS key that is `nodeid` or a prefix of it ending
    at a boundary (a path separator, "::" or "["); "pr" when no key matches."""
    best, tier = -1, "pr"
    for key, (value, _why) in TIERS.items():
        if len(key) > best and (
            nodeid == key or (nodeid.startswith(key) and (key.endswith("/") or nodeid[len(key)] in ":["))
        ):
            best, tier = len(key), value
    return tier


def _function(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def load_durations() -> dict[str, float]:
    return json.loads(DURATIONS.read_text())["seconds"] if DURATIONS.exists() else {}


def _units(ids: list[str], durations: dict[str, float], share: float, levels=(_module, _function)) -> list[list[str]]:
    """`ids` grouped by the first of `levels` (module, then test function) whose group takes at
    most `share` seconds; a larger group is split by the next level, and at the last into tests."""
    if not levels:
        return [[i] for i in ids]
    groups: dict[str, list[str]] = defaultdict(list)
    for i in ids:
        groups[levels[0](i)].append(i)
    units = []
    for group in groups.values():
        if sum(durations[i] for i in group) <= share:
            units.append(group)
        else:
            units += _units(group, durations, share, levels[1:])
    return units


def assign_shards(slow_ids: list[str], durations: dict[str, float], shards: int = SHARDS) -> dict[str, int]:
    """Node id -> shard for `slow_ids`, balanced by `durations` (see the module docstring)."""
    share = sum(durations.get(i, UNKNOWN_SECONDS) for i in slow_ids) / shards
    units = _units([i for i in slow_ids if i in durations], durations, share)
    loads = [0.0] * shards
    out = {}
    for unit in sorted(units, key=lambda ids: (-sum(durations[i] for i in ids), ids[0])):
        shard = min(range(shards), key=lambda s: (loads[s], s))
        loads[shard] += sum(durations[i] for i in unit)
        out.update({i: shard for i in unit})
    for i in slow_ids:
        if i not in durations:
            out[i] = zlib.crc32(_module(i).encode()) % shards
    return out


def auto_shard(root: Path) -> int:
    """The checkout's commit count modulo SHARDS: consecutive commits run consecutive shards."""
    try:
        count = subprocess.run(
            ["git", "rev-list", "--count", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise pytest.UsageError(f"--shard auto: cannot count this checkout's commits ({e}); pass --shard K") from e
    return int(count) % SHARDS


def pytest_addoption(parser):
    group = parser.getgroup("tiers", "test tiers (tests/tiers.py)")
    group.addoption("--tier", choices=("pr", "slow", "all"), default="pr", help="which tier to run (default: pr)")
    group.addoption(
        "--shard",
        default=None,
        help=f"with --tier slow or all: only this shard of the slow tier, 0 to {SHARDS - 1}, or 'auto' "
        "(the commit count modulo the number of shards)",
    )


def _shard_option(config) -> int | None:
    value = config.getoption("--shard")
    if value is None:
        return None
    if config.getoption("--tier") == "pr":
        raise pytest.UsageError("--shard picks part of the slow tier: pass --tier slow or --tier all with it")
    if value == "auto":
        return auto_shard(config.rootpath)
    if not value.isdigit() or int(value) >= SHARDS:
        raise pytest.UsageError(f"--shard {value}: must be 'auto' or an integer from 0 to {SHARDS - 1}")
    return int(value)


def pytest_collection_modifyitems(session, config, items):
    config.stash[_COLLECTED] = [item.nodeid for item in items]
    tier, shard = config.getoption("--tier"), _shard_option(config)
    slow = [item.nodeid for item in items if tier_of(item.nodeid) == "slow"]
    shards = assign_shards(slow, load_durations())
    selected, keep, drop = {}, [], []
    for item in items:
        if tier_of(item.nodeid) == "pr":
            label = "pr" if tier in ("pr", "all") else None
        else:
            runs = tier in ("slow", "all") and shard in (None, shards[item.nodeid])
            label = f"slow shard {shards[item.nodeid]}" if runs else None
        (keep if label else drop).append(item)
        if label:
            selected[item.nodeid] = label
    config.stash[_SELECTED] = selected
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def collected_ids(config) -> list[str]:
    """Every test this session collected, whatever its tier (for tests/test_tiers.py)."""
    return config.stash[_COLLECTED]


def pytest_terminal_summary(terminalreporter, config):
    selected = config.stash.get(_SELECTED, None)
    if not selected:
        return
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, set] = defaultdict(set)
    for reports in terminalreporter.stats.values():
        for report in reports:
            label = selected.get(getattr(report, "nodeid", None))
            if label is not None and hasattr(report, "duration"):
                seconds[label] += report.duration
                tests[label].add(report.nodeid)
    for label in sorted(seconds, key=lambda s: (s != "pr", s)):
        terminalreporter.write_line(f"tier {label}: {len(tests[label])} tests, {seconds[label]:.1f} s")


def _junit_seconds(paths: list[str]) -> dict[str, float]:
    seconds: dict[str, float] = defaultdict(float)
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            if not case.get("classname"):  # a module skipped at collection
                continue
            module = case.get("classname").replace(".", "/") + ".py"
            seconds[f"{module}::{case.get('name')}"] += float(case.get("time"))
    return dict(seconds)


def write_durations(paths: list[str]) -> None:
    load = os.getloadavg()
    DURATIONS.write_text(
        json.dumps(
            {
                "measured": datetime.date.today().isoformat(),
                "machine": f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load {load[0]:.1f} at the end",
                "from": [os.path.basename(p) for p in paths],
                "seconds": {k: round(v, 2) for k, v in sorted(_junit_seconds(paths).items())},
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "durations":
        sys.exit(f"usage: python {sys.argv[0]} durations JUNIT.xml...")
    write_durations(sys.argv[2:])
