"""200 requests through the engine: identical to transformers under preemption, prefix caching,
chunked prefill and aborts, and no block leaks."""

import numpy as np
import pytest
from engine_fixtures import hf_greedy, make_model_dir

from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.sampling_params import SamplingParams

NUM_REQUESTS = 200
MAX_MODEL_LEN = 128
ABORT_EVERY = 17  # requests whose index is a multiple of this are aborted midway


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    """(model dir, prompts, max_tokens, HF greedy continuations)."""
    path = str(tmp_path_factory.mktemp("engine_model"))
    hf_model = make_model_dir(path)
    rng = np.random.default_rng(0)
    shared = [rng.integers(3, 512, size=n).tolist() for n in (40, 33, 64)]
    prompts, max_tokens = [], []
    for i in range(NUM_REQUESTS):
        own = rng.integers(3, 512, size=int(rng.integers(1, 30))).tolist()
        prompts.append(shared[i % 3] + own if i % 2 else own)
        max_tokens.append(int(rng.integers(1, 24)))
    references = [hf_greedy(hf_model, p, m) for p, m in zip(prompts, max_tokens)]
    return path, prompts, max_tokens, references


def run(path, prompts, max_tokens, **engine_kwargs):
    """Runs every request to the end, aborting some midway; returns (outputs by id, engine)."""
    engine = LLMEngine(EngineArgs(model=path, dtype="float32", max_model_len=MAX_MODEL_LEN, **engine_kwargs))
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(
            str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        )
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = out
        steps += 1
        if steps == 6:
            engine.abort_request([str(i) for i in range(0, NUM_REQUESTS, ABORT_EVERY)])
    return outputs, engine


def check_against_hf(outputs, references):
    for i, ref in enumerate(references):
        completion = outputs[i].outputs[0]
        if i % ABORT_EVERY == 0:
            assert completion.finish_reason == "abort" or completion.token_ids == ref, f"request {i}"
            assert completion.token_ids == ref[: len(completion.token_ids)], f"aborted request {i}"
        else:
            assert completion.finish_reason == "length", f"request {i}"
            assert completion.token_ids == ref, f"request {i}: differs from transformers"


def check_no_leaks(engine):
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks
    assert all(c == 0 for c in bm.ref_counts)
    assert not engine.output_processor.requests


def test_small_pool_preempts_and_matches_transformers(workload):
    path, prompts, max_tokens, references = workload
    # 24 blocks of 16 tokens: far fewer than 16 running sequences need, so preemption happens.
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 16
    outputs, engine = run(
        path,
        prompts,
        max_tokens,
        kv_cache_memory_bytes=25 * bytes_per_block,
        max_num_seqs=16,
        max_num_batched_tokens=128,
    )
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
    check_against_hf(outputs, references)
    check_no_leaks(engine)


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(max_num_seqs=32, max_num_batched_tokens=256),  # unconstrained pool
        dict(max_num_seqs=32, max_num_batched_tokens=256, enable_prefix_caching=False),
        dict(max_num_seqs=16, max_num_batched_tokens=16),  # chunked prefill: 16 tokens per step
    ],
    ids=["large-pool", "no-prefix-cache", "chunked-prefill"],
)
def test_other_configurations_give_the_same_tokens(workload, engine_kwargs):
    path, prompts, max_tokens, references = workload
    outputs, engine = run(path, prompts, max_tokens, **engine_kwargs)
    check_against_hf(outputs, references)
    check_no_leaks(engine)
    if engine_kwargs.get("enable_prefix_caching", True):
        assert engine.get_stats()["prefix_cache_hits"] > 0
    else:
        assert engine.get_stats()["prefix_cache_hits"] == 0


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_host_tier_reloads_evicted_blocks_swaps_and_matches_transformers(workload, caching):
    """The small pool again, with a host tier: evicted prefix blocks come back from host memory
    and preempted sequences are swapped out and in (not recomputed), with the same tokens."""
    path, prompts, max_tokens, references = workload
    bytes_per_block = 2 * 2 * 2 * 16 * 4 * 16
    outputs, engine = run(
        path,
        prompts,
        max_tokens,
        kv_cache_memory_bytes=25 * bytes_per_block,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        kv_offloading_size=48 * bytes_per_block / 2**30,
        enable_prefix_caching=caching,
    )
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["kv_swapped_in_blocks"] > 0
    assert stats["kv_offload_bytes"] > 0 and stats["kv_load_bytes"] > 0
    assert (stats["external_prefix_cache_hits"] > 0) == caching
    check_against_hf(outputs, references)
    check_no_leaks(engine)
    tier = engine.scheduler.block_manager.host_tier
    assert tier.num_slots == 48 and not tier.swapped and tier.num_free + len(tier.cached) == tier.num_slots
    assert len(engine.runner.kv_transfer._compiled) == 8  # every copy program compiled at start-up


def test_bfloat16_demo_model_gives_the_same_tokens_through_the_host_tier():
    """The shipped bfloat16 model: a pool too small for its prompts' prefixes plus a host tier
    (evictions and host hits) against a pool that never evicts; the same greedy tokens."""
    from jaxpaged import LLM
    from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR

    rng = np.random.default_rng(1)
    prefixes = [rng.integers(3, 4000, size=70).tolist() for _ in range(3)]
    prompts = [{"prompt_token_ids": prefixes[i % 3] + rng.integers(3, 4000, size=5).tolist()} for i in range(9)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    common = dict(max_model_len=96, max_num_seqs=1, max_num_batched_tokens=96)  # one at a time: the prefixes rotate
    big = LLM(DEMO_MODEL_DIR, **common)
    block_bytes = 2 * 4 * 2 * 64 * 4 * 16  # K and V x layers x kv heads x head_dim x float32 storage x tokens
    small = LLM(
        DEMO_MODEL_DIR, **common, kv_cache_memory_bytes=9 * block_bytes, kv_offloading_size=64 * block_bytes / 2**30
    )
    assert str(small.llm_engine.runner.params_dtype) == "bfloat16"
    expected = [o.outputs[0].token_ids for o in big.generate(prompts, greedy, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in small.generate(prompts, greedy, use_tqdm=False)] == expected
    stats = small.get_stats()
    assert stats["external_prefix_cache_hits"] > 0 and stats["kv_offload_bytes"] > 0
