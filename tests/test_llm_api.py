"""The vLLM-style API: LLM.generate / chat, sampling features, streaming, aborts, errors, donation."""

import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from engine_fixtures import hf_greedy
from shared_engines import CANONICAL

from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.entrypoints.llm import LLM
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model


# The engines of this module that load the model's weights take the shared "tiny" engine's
# options: equal options give equal step programs, compiled once.
OPTIONS = CANONICAL["tiny"]


@pytest.fixture(scope="module")
def llm(shared_engines):
    return shared_engines.get("tiny")


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_generate_returns_outputs_in_order_with_vllm_fields(llm, model_dir):
    prompts = ["hello there", "the quick brown fox jumps", {"prompt_token_ids": [1, 9, 8, 7]}]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.prompt for o in outs] == ["hello there", "the quick brown fox jumps", None]
    for out in outs:
        c = out.outputs[0]
        assert out.finished and c.finish_reason == "length" and c.index == 0 and len(c.token_ids) == 12
        assert c.token_ids == hf_greedy(model_dir[1], out.prompt_token_ids, 12)
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
        assert out.metrics.arrival_time <= out.metrics.first_token_time <= out.metrics.finished_time


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(["a", "b"], [greedy(3), greedy(5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate(["a", "b"], [greedy(3)] * 3, use_tqdm=False)


def test_seeded_request_is_independent_of_its_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    [alone] = llm.generate(["the quick brown fox"], params, use_tqdm=False)
    others = [SamplingParams(temperature=0.8, max_tokens=int(m), ignore_eos=True) for m in np.arange(32) % 7 + 1]
    batch = llm.generate(
        [f"prompt {i}" for i in range(32)] + ["the quick brown fox"], others + [params], use_tqdm=False
    )
    assert batch[-1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_parallel_sampling_shares_the_prompt(llm):
    [out] = llm.generate(["the lazy dog"], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "n samples should differ"


def test_logprobs(llm):
    [out] = llm.generate(["hello"], greedy(5, logprobs=3), use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for token, entry in zip(c.token_ids, c.logprobs):
        assert token in entry and entry[token].rank == 1 and len(entry) >= 3
        assert all(lp.logprob <= 0 for lp in entry.values())
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)), rel=1e-5)


def test_stop_strings_and_stop_token_ids(llm):
    [base] = llm.generate(["once upon"], greedy(20), use_tqdm=False)
    text, ids = base.outputs[0].text, base.outputs[0].token_ids
    stop = text[5:8]
    [out] = llm.generate(["once upon"], greedy(20, stop=[stop]), use_tqdm=False)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == text[: text.index(stop)]
    [kept] = llm.generate(["once upon"], greedy(20, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)
    assert kept.outputs[0].text == text[: text.index(stop) + len(stop)]
    [by_id] = llm.generate(["once upon"], greedy(20, stop_token_ids=[ids[3]]), use_tqdm=False)
    assert by_id.outputs[0].token_ids == ids[: ids.index(ids[3]) + 1]
    assert by_id.outputs[0].stop_reason == ids[3] and by_id.outputs[0].finish_reason == "stop"


def test_min_tokens_bans_stop_tokens_until_reached(llm):
    [base] = llm.generate(["once upon"], greedy(10), use_tqdm=False)
    first = base.outputs[0].token_ids[0]
    [out] = llm.generate(["once upon"], greedy(10, stop_token_ids=[first], min_tokens=4), use_tqdm=False)
    assert first not in out.outputs[0].token_ids[:4]


def test_chat_applies_the_template(llm):
    messages = [{"role": "user", "content": "hi"}]
    [out] = llm.chat(messages, greedy(4), use_tqdm=False)
    expected = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert out.prompt_token_ids == list(expected)


def test_streaming_deltas_add_up_and_abort_frees_blocks(model_dir):
    engine = LLMEngine(EngineArgs(model=model_dir[0], **OPTIONS))
    engine.add_request("s", "hello there", greedy(10, output_kind=RequestOutputKind.DELTA))
    engine.add_request("a", "abort me", greedy(50, output_kind=RequestOutputKind.DELTA))
    text, tokens = "", []
    for _ in range(3):
        for out in engine.step():
            if out.request_id == "s":
                text += out.outputs[0].text
                tokens += out.outputs[0].token_ids
    engine.abort_request("a")
    outs = engine.step()
    aborted = [o for o in outs if o.request_id == "a"]
    for out in outs:
        if out.request_id == "s":
            text += out.outputs[0].text
            tokens += out.outputs[0].token_ids
    assert aborted and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            tokens += out.outputs[0].token_ids
    assert len(tokens) == 10 and text == engine.tokenizer.decode(tokens, skip_special_tokens=True)
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_output_kinds(llm):
    """CUMULATIVE outputs grow every step; FINAL_ONLY reports once, at the end."""
    engine = llm.llm_engine
    engine.add_request("cumulative", "one two", greedy(6))
    engine.add_request("final", "one two", greedy(6, output_kind=RequestOutputKind.FINAL_ONLY))
    seen = {"cumulative": [], "final": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out.outputs[0].token_ids)
    assert len(seen["final"]) == 1 and len(seen["final"][0]) == 6
    assert len(seen["cumulative"]) > 1 and seen["cumulative"][-1] == seen["final"][0]
    assert all(a == b[: len(a)] for a, b in zip(seen["cumulative"], seen["cumulative"][1:]))


@pytest.mark.parametrize(
    "prompt,params,match",
    [
        ("x" * 10, dict(max_tokens=200), "max_model_len"),
        ("hi", dict(logprobs=21), "logprobs"),
        ({"prompt_token_ids": [1, 99999]}, dict(max_tokens=2), "vocabulary"),
        ({"prompt_token_ids": []}, dict(max_tokens=2), "empty"),
        (3.5, dict(max_tokens=2), "prompt must be"),
    ],
)
def test_bad_requests_raise_and_the_engine_keeps_running(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(**params), use_tqdm=False)
    [out] = llm.generate(["still fine"], greedy(2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_bad_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_step_donates_the_cache_and_never_recompiles(llm, caplog):
    runner = llm.llm_engine.runner
    old_k = runner.cache.kv.k
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            llm.generate(["donate", "the pool please"], greedy(6), use_tqdm=False)
    finally:
        jax.config.update("jax_log_compiles", False)
    assert old_k.is_deleted(), "the pool passed to a step must be donated"
    compiles = [r.getMessage() for r in caplog.records if "compil" in r.getMessage().lower()]
    assert not compiles, f"compiled after warm-up: {compiles[:3]}"


def test_dummy_weights_from_a_config_only_directory(tmp_path, model_dir):
    import shutil

    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model_dir[0]}/{name}", tmp_path / name)
    llm = LLM(str(tmp_path), load_format="dummy", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32)
    [out] = llm.generate(["hi"], greedy(3), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_fused_decode_steps_change_nothing(model_dir):
    """Sampled, penalised and stopped requests give the same tokens with 1 or 4 fused decode steps."""
    params = [
        SamplingParams(temperature=0.9, top_k=20, seed=3, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.7, presence_penalty=0.5, repetition_penalty=1.3, seed=4, max_tokens=9),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[7, 8, 9]),
    ]
    results = []
    for steps in (1, 4):
        llm = LLM(model_dir[0], **OPTIONS, num_scheduler_steps=steps)
        outs = llm.generate(["one", "two three", "four five six"], params, use_tqdm=False)
        results.append([o.outputs[0].token_ids for o in outs])
        bm = llm.llm_engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.num_total_blocks
    assert results[0] == results[1]


def test_compilation_cache_dir_keeps_the_step_programs(model_dir, tmp_path):
    """In a fresh process, as a user would start an engine (JAX's cache is process-wide)."""
    cache = tmp_path / "xla-cache"
    code = (
        "from jaxpaged.entrypoints.llm import LLM\n"
        f"LLM({model_dir[0]!r}, dtype='float32', max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,"
        f" compilation_cache_dir={str(cache)!r})\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}
    )
    names = os.listdir(cache)
    assert all(
        any(f"_{kind}" in n for n in names) for kind in ("model_program", "sampler_program", "fused_decode_steps")
    )


def test_skip_tokenizer_init_runs_token_ids_from_a_config_only_directory(tmp_path, model_dir):
    import shutil

    shutil.copy(f"{model_dir[0]}/config.json", tmp_path / "config.json")
    llm = LLM(
        str(tmp_path),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=32,
    )
    [out] = llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(5, logprobs=1), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(["text"], greedy(2), use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings"):
        llm.generate([{"prompt_token_ids": [1]}], greedy(2, stop=["x"]), use_tqdm=False)


def test_three_quarter_token_buckets_give_the_tokens_of_the_powers(llm, model_dir):
    """300 sequences decode in the 384-token bucket (a 3/4 point: max_num_seqs 384) with the
    tokens the shared engine gives them 16 at a time in power-of-two buckets."""
    prompts = [{"prompt_token_ids": [3 + i % 400, 5 + i % 7, 11]} for i in range(300)]
    params = greedy(3)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    wide = LLM(model_dir[0], dtype="float32", max_model_len=16, max_num_seqs=384, max_num_batched_tokens=384)
    packer = wide.llm_engine.runner.packer
    assert 384 in packer.layouts and packer.bucket_for(300, 300) == 384
    assert [o.outputs[0].token_ids for o in wide.generate(prompts, params, use_tqdm=False)] == expected


def test_start_and_stop_profile_write_a_trace_of_the_steps(llm, tmp_path):
    """`LLM.start_profile` / `stop_profile` (vLLM's): a jax.profiler trace of the generation in
    between, in the directory given; a second start while one runs, or a stop with none, is a
    RuntimeError naming why; generation is unchanged."""
    before = llm.generate(["hello there"], greedy(4))[0].outputs[0].token_ids
    with pytest.raises(RuntimeError, match="no profile is running"):
        llm.stop_profile()
    llm.start_profile(str(tmp_path))
    with pytest.raises(RuntimeError, match="already being written"):
        llm.start_profile(str(tmp_path))
    during = llm.generate(["hello there"], greedy(4))[0].outputs[0].token_ids
    run = llm.stop_profile()
    [trace] = (tmp_path / "plugins" / "profile").glob("*/*.xplane.pb")
    assert str(trace.parent) == run and trace.stat().st_size > 10_000 and during == before
