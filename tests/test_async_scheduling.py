"""Async scheduling (each step dispatched before the previous one's tokens are read, which reach
it on the device) gives exactly the outputs of synchronous steps: greedy and seeded sampling,
n > 1, filters, penalties, min_tokens, logprobs, stop strings and stop token ids, max_tokens
exactly, n-gram and draft-model speculation switched on and off, fused decode windows that end mid-way,
preemption by recompute and by swap, host-tier hits, tensor parallelism; and every block and
runner slot comes back."""

import numpy as np
import pytest
from engine_fixtures import make_model_dir

from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.sampling_params import SamplingParams

MAX_MODEL_LEN = 96
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # K and V x layers x kv heads x head_dim x float32 x 16 tokens


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("async_model"))
    make_model_dir(path)
    return path


PROBE = list(range(40, 52))


def workload(stop_text: str, stop_token: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts sharing prefixes, with every kind of sampling the engine offers (the stop rules
    are met by `PROBE`'s greedy continuation, the prompt of their requests)."""
    rng = np.random.default_rng(3)
    shared = [rng.integers(3, 500, size=n).tolist() for n in (35, 20)]
    kinds = [
        dict(temperature=0, ignore_eos=True),
        dict(temperature=0.8, seed=11, ignore_eos=True),
        dict(temperature=1.0, top_p=0.9, seed=12, ignore_eos=True),
        dict(temperature=1.0, top_k=5, seed=13, ignore_eos=True),
        dict(temperature=0.9, n=2, seed=14, ignore_eos=True),
        dict(temperature=0, logprobs=3, ignore_eos=True),
        dict(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.3, seed=15, ignore_eos=True),
        dict(temperature=0.9, min_tokens=6, seed=16),
        dict(temperature=0, stop=[stop_text], include_stop_str_in_output=False, ignore_eos=True),
        dict(temperature=0, stop_token_ids=[stop_token], ignore_eos=True),
    ]
    requests = []
    for i in range(24):
        prompt = (shared[i % 2] if i % 3 else []) + rng.integers(3, 500, size=int(rng.integers(1, 12))).tolist()
        kind = kinds[i % len(kinds)]
        max_tokens = int(rng.integers(kind.get("min_tokens", 1), 24))
        if "stop" in kind or "stop_token_ids" in kind:
            prompt, max_tokens = PROBE, 20
        requests.append((prompt, SamplingParams(max_tokens=max_tokens, **kind)))
    return requests


def run(engine: LLMEngine, requests) -> dict[str, list[tuple]]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = [
                    (
                        c.token_ids,
                        c.text,
                        c.finish_reason,
                        c.stop_reason,
                        c.cumulative_logprob,
                        [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs or []],
                    )
                    for c in out.outputs
                ]
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and not any(bm.ref_counts) and not engine.output_processor.requests
    assert (
        engine.runner.input_batch.num_free_slots < engine.config.scheduling.max_num_seqs or not engine.scheduler.running
    )
    engine.step()  # the next schedule hands the last finished sequences' slots back
    assert engine.runner.input_batch.num_free_slots == engine.config.scheduling.max_num_seqs
    return outputs


def assert_same_outputs(got: dict[str, list[tuple]], expected: dict[str, list[tuple]]) -> None:
    """The same tokens, text, finish and stop reasons and top-logprob ids, and logprobs within
    1e-3 (a batch of other sizes sums float32s in another order)."""
    assert got.keys() == expected.keys()
    for request_id, completions in expected.items():
        assert len(got[request_id]) == len(completions), request_id
        for (*exact, cumulative, logprobs), (*exact_got, cumulative_got, logprobs_got) in zip(
            completions, got[request_id]
        ):
            assert exact_got == exact, request_id
            assert (cumulative is None) == (cumulative_got is None), request_id
            if cumulative is not None:
                assert cumulative_got == pytest.approx(cumulative, abs=1e-3), request_id
            assert [e.keys() for e in logprobs_got] == [e.keys() for e in logprobs], request_id
            for e, e_got in zip(logprobs, logprobs_got):
                assert [e_got[t] for t in e] == pytest.approx([e[t] for t in e], abs=1e-3), request_id


def engines(path: str, **options) -> tuple[LLMEngine, LLMEngine]:
    common = dict(
        model=path, dtype="float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=64, **options
    )
    return LLMEngine(EngineArgs(async_scheduling=False, **common)), LLMEngine(
        EngineArgs(async_scheduling=True, **common)
    )


def stop_rules(sync: LLMEngine) -> tuple[str, int]:
    """A stop string and a stop token id that the greedy continuation of a prompt does reach."""
    sync.add_request(
        "probe", {"prompt_token_ids": PROBE}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )
    done = None
    while sync.has_unfinished_requests():
        done = [o for o in sync.step() if o.finished] or done
    text, tokens = done[0].outputs[0].text, done[0].outputs[0].token_ids
    return text[len(text) // 2 : len(text) // 2 + 3], tokens[6]


CONFIGS = {
    "fused-windows": dict(num_scheduler_steps=4),
    "preempt-recompute": dict(num_scheduler_steps=1, kv_cache_memory_bytes=12 * BLOCK_BYTES),
    "swap-and-host-hits": dict(kv_cache_memory_bytes=12 * BLOCK_BYTES, kv_offloading_size=40 * BLOCK_BYTES / 2**30),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_async_outputs_equal_sync_outputs(model_path, name):
    sync, asyn = engines(model_path, **CONFIGS[name])
    assert asyn.runner.async_scheduling and not sync.runner.async_scheduling
    requests = workload(*stop_rules(sync))
    expected = run(sync, requests)
    got = run(asyn, requests)
    assert_same_outputs(got, expected)
    finishes = {c[2] for outs in expected.values() for c in outs}
    assert finishes == {"stop", "length"}  # stop strings and stop token ids did stop something
    stats = asyn.get_stats()
    if name != "fused-windows":
        assert stats["num_preemptions"] > 0
    if name == "swap-and-host-hits":
        assert stats["kv_swapped_in_blocks"] > 0 and stats["external_prefix_cache_hits"] > 0


@pytest.mark.parametrize("n", [2, 4])
def test_async_equals_sync_under_tensor_parallelism(model_path, n):
    sync, asyn = engines(model_path, tensor_parallel_size=n, kv_cache_memory_bytes=24 * BLOCK_BYTES // n)
    requests = workload(*stop_rules(sync))
    assert_same_outputs(run(asyn, requests), run(sync, requests))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_async_equals_sync_when_steps_switch_between_speculating_and_not(model_path, method):
    """Speculation under async scheduling (n-gram lookups, or the model as its own draft): a step
    that speculates reads the step in flight first (and is read at its end: a draft proposes for
    the next step from its tokens), a plain step after it overlaps again. The governor's choice
    (timed, so not repeatable) is replaced by a fixed pattern that switches every two steps."""
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if method == "draft":
        spec = {"model": model_path, "num_speculative_tokens": 2}
    sync, asyn = engines(model_path, num_scheduler_steps=4, speculative_config=spec)
    assert asyn.runner.async_scheduling
    for engine in (sync, asyn):
        calls = iter(range(10**6))
        engine.governor.speculate = lambda running, calls=calls: next(calls) // 2 % 2 == 0
    requests = workload(*stop_rules(sync))
    assert_same_outputs(run(asyn, requests), run(sync, requests))
    assert asyn.spec_stats["spec_decode_num_draft_tokens"] > 0


def test_aborts_in_flight_leave_nothing_behind(model_path):
    """Requests aborted while their step is on the device: their tokens are dropped, every block
    and slot comes back, and the others' outputs are those of a run without the aborted ones."""
    sync, asyn = engines(model_path, num_scheduler_steps=1)
    requests = workload("zz", 7)
    kept_ids = [i for i in range(len(requests)) if i % 5]
    kept = [requests[i] for i in kept_ids]
    expected = run(sync, kept)
    for i, (prompt, params) in enumerate(requests):
        asyn.add_request(str(i), {"prompt_token_ids": prompt}, params)
    got, steps = {}, 0
    while asyn.has_unfinished_requests():
        for out in asyn.step():
            if out.finished and int(out.request_id) % 5:
                got[str(kept_ids.index(int(out.request_id)))] = [(c.token_ids, c.finish_reason) for c in out.outputs]
        steps += 1
        if steps == 3:
            asyn.abort_request([str(i) for i in range(0, len(requests), 5)])
    assert got == {k: [(c[0], c[2]) for c in v] for k, v in expected.items()}
    bm = asyn.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and not any(bm.ref_counts)
    asyn.step()
    assert asyn.runner.input_batch.num_free_slots == asyn.config.scheduling.max_num_seqs
