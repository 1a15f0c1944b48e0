"""`prompt_logprobs` and `logit_bias` through the Python API: prompt logprobs equal transformers'
log_softmax (across prefill chunks, with prefix caching around) and the sampler's own logprobs;
a logit bias of +100 forces a token and -100 bans it."""

import numpy as np
import pytest
import torch

from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

# The shared "tiny" engine prefills at most 64 tokens a step: a 70-token prompt is two chunks.


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def llm(shared_engines):
    return shared_engines.get("tiny")


def greedy(max_tokens=3, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def hf_log_softmax(hf_model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].double(), -1).numpy()


def random_prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=length).tolist()


def check_against_transformers(prompt_logprobs, prompt, reference, k):
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        entry, row = prompt_logprobs[j], reference[j - 1]
        token = prompt[j]
        assert entry[token].logprob == pytest.approx(row[token], abs=1e-4)
        # (float32 against float64: tokens within 1e-5 of it may rank either way)
        assert 1 + np.sum(row > row[token] + 1e-5) <= entry[token].rank <= 1 + np.sum(row > row[token] - 1e-5)
        top = sorted((t for t in entry if t != token or entry[t].rank <= k), key=lambda t: entry[t].rank)[:k]
        assert top == np.argsort(-row)[:k].tolist()
        assert len(entry) in (k, k + 1)


def test_prompt_logprobs_match_transformers_across_chunks(llm, model_dir):
    prompt = random_prompt(0, 70)  # longer than two chunks
    [out] = llm.generate([{"prompt_token_ids": prompt}], greedy(prompt_logprobs=5), use_tqdm=False)
    check_against_transformers(out.prompt_logprobs, prompt, hf_log_softmax(model_dir[1], prompt), 5)
    assert out.prompt_logprobs[1][prompt[1]].decoded_token == llm.llm_engine.tokenizer.decode([prompt[1]])


def test_prompt_logprobs_zero_and_one_token_prompt(llm, model_dir):
    prompt = random_prompt(1, 20)
    short, only = llm.generate(
        [{"prompt_token_ids": prompt}, {"prompt_token_ids": [7]}], greedy(prompt_logprobs=0), use_tqdm=False
    )
    assert only.prompt_logprobs == [None]
    reference = hf_log_softmax(model_dir[1], prompt)
    for j in range(1, len(prompt)):
        assert list(short.prompt_logprobs[j]) == [prompt[j]]
        assert short.prompt_logprobs[j][prompt[j]].logprob == pytest.approx(reference[j - 1, prompt[j]], abs=1e-4)


def test_prompt_logprobs_equal_sampling_logprobs(llm):
    """Scoring a prompt followed by its greedy continuation gives the continuation's sampling logprobs."""
    prompt = random_prompt(2, 40)
    [gen] = llm.generate([{"prompt_token_ids": prompt}], greedy(6, logprobs=1), use_tqdm=False)
    c = gen.outputs[0]
    full = prompt + c.token_ids
    [scored] = llm.generate([{"prompt_token_ids": full}], greedy(1, prompt_logprobs=1), use_tqdm=False)
    for j, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        got = scored.prompt_logprobs[len(prompt) + j][token]
        assert got.logprob == pytest.approx(entry[token].logprob, abs=1e-4)
        assert got.rank == entry[token].rank == 1


def test_prompt_logprobs_take_no_prefix_hit_but_leave_blocks_for_others(llm, model_dir):
    prompt = random_prompt(3, 70)
    [first] = llm.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False)
    [scored] = llm.generate([{"prompt_token_ids": prompt}], greedy(prompt_logprobs=2), use_tqdm=False)
    assert scored.num_cached_tokens == 0
    check_against_transformers(scored.prompt_logprobs, prompt, hf_log_softmax(model_dir[1], prompt), 2)
    [again] = llm.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False)
    assert again.num_cached_tokens >= 64 and again.prompt_logprobs is None
    assert first.outputs[0].token_ids == scored.outputs[0].token_ids == again.outputs[0].token_ids


def test_prompt_logprobs_in_a_mixed_batch_with_n_and_streaming(llm, model_dir):
    prompts = [random_prompt(4, 50), random_prompt(5, 9)]
    params = [
        SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=4, prompt_logprobs=3),
        greedy(8),
    ]
    scored, plain = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert len(scored.outputs) == 2 and plain.prompt_logprobs is None
    check_against_transformers(scored.prompt_logprobs, prompts[0], hf_log_softmax(model_dir[1], prompts[0]), 3)

    engine = llm.llm_engine
    delta = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=1, output_kind=RequestOutputKind.DELTA)
    engine.add_request("stream", {"prompt_token_ids": prompts[0]}, delta)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    with_logprobs = [o for o in outputs if o.prompt_logprobs is not None]
    assert len(with_logprobs) == 1 and len(with_logprobs[0].prompt_logprobs) == len(prompts[0])


def test_prompt_logprobs_limit(llm):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate(["hi"], greedy(prompt_logprobs=21), use_tqdm=False)


def test_logit_bias_forces_and_bans_tokens(llm):
    prompt = {"prompt_token_ids": random_prompt(6, 12)}
    [base] = llm.generate([prompt], greedy(6), use_tqdm=False)
    first = base.outputs[0].token_ids[0]
    forced, banned, both = llm.generate(
        [prompt] * 3,
        [
            greedy(6, logit_bias={42: 100.0}),
            greedy(6, logit_bias={first: -100.0}),
            greedy(6, logit_bias={first: -100.0, 42: 100.0}),
        ],
        use_tqdm=False,
    )
    assert forced.outputs[0].token_ids == [42] * 6
    assert banned.outputs[0].token_ids[0] != first and first not in banned.outputs[0].token_ids
    assert both.outputs[0].token_ids == [42] * 6
    # Reported logprobs stay the model's own (raw), as vLLM reports them.
    [lp] = llm.generate([prompt], greedy(1, logit_bias={42: 100.0}, logprobs=0), use_tqdm=False)
    assert lp.outputs[0].logprobs[0][42].logprob < -1.0


def test_logit_bias_with_sampling_and_limits(llm):
    prompt = {"prompt_token_ids": random_prompt(7, 5)}
    [out] = llm.generate(
        [prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=8, logit_bias={9: 100}), use_tqdm=False
    )
    assert out.outputs[0].token_ids == [9] * 8
    with pytest.raises(ValueError, match="logit_bias has 301 entries; at most 300"):
        llm.generate([prompt], greedy(logit_bias={i: 1.0 for i in range(301)}), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([prompt], greedy(logit_bias={512: 1.0}), use_tqdm=False)
    # The engine keeps running.
    [ok] = llm.generate([prompt], greedy(2, logit_bias={i: -100.0 for i in range(300)}), use_tqdm=False)
    assert all(t >= 300 for t in ok.outputs[0].token_ids)


def test_prompt_logprobs_and_logit_bias_agree_under_tensor_parallelism(tmp_path):
    import tp_workload
    from tiny_models import save_hf_model

    from jaxpaged.engine.llm_engine import LLMEngine
    from jaxpaged.engine_args import EngineArgs

    hf = save_hf_model("llama_tp", str(tmp_path))
    prompt = random_prompt(8, 40)  # three chunks of 16
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, logit_bias={7: -100.0, 11: 5.0})
    outs = {}
    for n in (1, 2):
        engine = LLMEngine(EngineArgs(**tp_workload.engine_options(str(tmp_path), n)))
        engine.add_request("r", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            outs.update((n, o) for o in engine.step() if o.finished)
    check_against_transformers(outs[2].prompt_logprobs, prompt, hf_log_softmax(hf, prompt), 2)
    assert outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids and 7 not in outs[2].outputs[0].token_ids


def test_prompt_logprobs_survive_preemption(tmp_path):
    """Three scored prompts in a pool too small for them at once: preempted mid-prompt (by
    recompute) they compute everything again, and still equal transformers."""
    import tp_workload
    from tiny_models import save_hf_model

    from jaxpaged.engine.llm_engine import LLMEngine
    from jaxpaged.engine_args import EngineArgs

    hf = save_hf_model("llama_tp", str(tmp_path))
    engine = LLMEngine(EngineArgs(**tp_workload.engine_options(str(tmp_path), 1)))
    prompts = [random_prompt(10 + i, 40) for i in range(3)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, greedy(3, prompt_logprobs=1))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.get_stats()["num_preemptions"] > 0
    for i, p in enumerate(prompts):
        check_against_transformers(done[str(i)].prompt_logprobs, p, hf_log_softmax(hf, p), 1)


def test_prompt_logprobs_of_a_three_quarter_bucket_run_in_chunks_that_divide_it():
    # T = 384 (a 3/4-point token bucket) in chunks of 128, the largest power of two dividing it
    # within PROMPT_LOGPROBS_CHUNK: the same rows as one log_softmax over every token.
    import jax
    import jax.numpy as jnp

    from jaxpaged.model.prompt_logprobs import prompt_logprobs, unpack_prompt_logprobs
    from jaxpaged.model.sampler import MAX_LOGPROBS

    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((384, 8)), jnp.float32)
    head = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 64, 384), jnp.int32)
    logprobs, ranks, top_ids, top_logprobs = unpack_prompt_logprobs(
        np.asarray(jax.jit(prompt_logprobs, static_argnums=1)(hidden, lambda h: h @ head, targets))
    )
    expected = np.asarray(jax.nn.log_softmax(hidden @ head, axis=-1))
    rows = np.arange(384)
    np.testing.assert_allclose(logprobs, expected[rows, np.asarray(targets)], atol=1e-5)
    assert (top_ids[:, 0] == expected.argmax(-1)).all() and top_ids.shape == (384, MAX_LOGPROBS)
    np.testing.assert_allclose(top_logprobs[:, 0], expected.max(-1), atol=1e-5)
    assert (ranks == 1 + (expected > expected[rows, np.asarray(targets)][:, None]).sum(-1)).all()
