"""Speculative decoding (n-gram and draft-model proposals): the same tokens as plain decoding,
greedy and seeded, through prefix hits, chunked prefill, preemption by recompute and by swap,
stop strings, streaming and tensor parallelism; the same distribution; vLLM's counters; bad
options named.

(That no rejected proposal's block is ever kept, cached or shared is the scheduler's property
test, `test_scheduler.py::test_random_workloads_keep_invariants_and_finish`, which runs with
proposals too.)
"""

import json

import numpy as np
import pytest
import tp_workload
from engine_fixtures import make_model_dir
from tiny_models import save_hf_model

from jaxpaged import LLM
from jaxpaged.config.speculative import SpeculativeConfig
from jaxpaged.core.speculation import NgramProposer
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs, EngineArgsError
from jaxpaged.engine_config import EngineConfig
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

DEMO_MODEL = "jaxpaged/demo_model"
# Every step that can speculates ("adaptive": False): these tests check what speculation does
# (tests/test_speculation_governor.py checks when it is turned off).
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
    "adaptive": False,
}


# -- proposals and options ----------------------------------------------------------------------


def test_ngram_proposals_follow_the_latest_longest_match():
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, 3, 1))
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 5, 6, 7]
    assert proposer.propose(tokens, 10) == [1, 5, 6]  # "5 6 7" last seen at 5, followed by 1 5 6
    assert proposer.propose(tokens, 2) == [1, 5]  # limited (max_tokens, max_model_len, budget)
    assert proposer.propose(tokens, 0) == []
    assert proposer.propose([1, 2, 3, 4], 5) == []  # no earlier occurrence of any suffix
    assert proposer.propose([4, 2, 9, 2], 5) == [9, 2]  # only "2" recurs (n = 1)
    assert proposer.propose([3, 3, 3], 5) == [
        3
    ]  # the match may overlap the suffix; proposals end at the sequence's end
    assert NgramProposer(SpeculativeConfig("ngram", 3, 3, 2)).propose([4, 2, 9, 2], 5) == []  # n >= 2 only


@pytest.mark.parametrize(
    "config, words",
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
        ({"model": "/no/such/dir", "num_speculative_tokens": 2}, "the draft model: is not a directory"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, 'needs the draft\'s directory as "model"'),
        ({"method": "ngram", "model": DEMO_MODEL, "num_speculative_tokens": 2}, "only it takes one"),
        ({"method": "ngram"}, "num_speculative_tokens=None must be an integer in"),
        ({"num_speculative_tokens": 99}, r"num_speculative_tokens=99 must be an integer in \[1, 16\]"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min=5 exceeds"),
        ("{not json", "is not JSON"),
    ],
)
def test_bad_speculative_configs_are_named(config, words):
    with pytest.raises(EngineArgsError, match=words) as err:
        EngineConfig.resolve(EngineArgs(model=DEMO_MODEL, speculative_config=config))
    assert err.value.field == "speculative_config"


def test_cli_flag_takes_json_and_names_itself(capsys):
    from jaxpaged.cli import main

    code = main(["generate", "--speculative-config", '{"method": "ngram"}', "hello"])
    assert code != 0 and "--speculative-config" in capsys.readouterr().err


# -- the engine: the same tokens -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("spec_model"))
    make_model_dir(path)
    return path


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat phrases (n-gram lookup finds them) and share prefixes."""
    rng = np.random.default_rng(seed)
    phrases = [rng.integers(3, 512, size=int(rng.integers(3, 7))).tolist() for _ in range(6)]
    shared = sum((phrases[i % 6] for i in range(5)), [])
    prompts = []
    for i in range(n):
        body = sum((phrases[int(j)] for j in rng.integers(0, 6, size=int(rng.integers(2, 8)))), [])
        prompts.append((shared if i % 2 else []) + body)
    return prompts


def run(path: str, prompts, params: list[SamplingParams], **kwargs):
    engine = LLMEngine(EngineArgs(model=path, dtype="float32", max_model_len=128, **kwargs))
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    done = {}
    while engine.has_unfinished_requests():
        done.update((int(o.request_id), o.outputs[0]) for o in engine.step() if o.finished)
    return [done[i] for i in range(len(prompts))], engine


def token_ids_and_stats(engine: LLMEngine, prompts, params: SamplingParams):
    """Every prompt (token ids) run to the end with `params`: their output token ids, and the stats."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((int(o.request_id), o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return [done[i] for i in range(len(prompts))], engine.get_stats()


# Engines of equal options share their compiled programs (JAX's in-memory cache): the tests
# below run their engines with these options, so that each set is compiled once per module.
ENGINES = {
    "roomy": dict(max_num_seqs=8, max_num_batched_tokens=128),
    "preempting": dict(kv_cache_memory_bytes=24 * 2 * 2 * 2 * 16 * 16 * 4, max_num_seqs=8, max_num_batched_tokens=64),
    "chunked": dict(max_num_seqs=8, max_num_batched_tokens=16),
    "swapping": dict(
        kv_cache_memory_bytes=24 * 2 * 2 * 2 * 16 * 16 * 4,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        kv_offloading_size=2**-12,
    ),
}


@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_speculation_gives_plain_greedy_tokens(tiny_dir, engine):
    prompts = repetitive_prompts(16)
    params = [
        SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True)
        for m in np.random.default_rng(1).integers(4, 40, size=len(prompts))
    ]
    plain, _ = run(tiny_dir, prompts, params, **ENGINES[engine])
    spec, spec_engine = run(tiny_dir, prompts, params, speculative_config=NGRAM, **ENGINES[engine])
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.finish_reason == "length" and len(o.token_ids) == p.max_tokens for o, p in zip(spec, params))
    stats = spec_engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]  # some rejected too
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if engine in ("preempting", "swapping"):
        assert stats["num_preemptions"] > 0
    if engine == "swapping":
        assert stats["kv_swapped_in_blocks"] > 0


# The demo model computes in bfloat16: a position's logits computed in another batch shape (one
# token, or a window of proposals) differ by bfloat16 rounding (~2e-3 measured).
BF16_LOGPROB_ATOL = 2e-2
SMALL_SCHEMA = {  # a document fits the demo runs' max_model_len
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "sex": {"enum": ["female", "male", "unknown"]}},
    "required": ["name", "sex"],
    "additionalProperties": False,
}
KJV = [
    "And the LORD spake unto Moses, saying, Speak unto the children of Israel, and say unto them,",
    "And it came to pass, when the king heard the words of the law, that he rent his clothes. And the king",
    "Blessed are the poor in spirit: for theirs is the kingdom of heaven. Blessed are they that mourn:",
]


def run_demo(prompts, params: list[SamplingParams], **kwargs):
    """The demo model (King James text: the lookup finds real repetition). 16 sequences of 1 + 3
    rows fit a 64-token step: one decode bucket, four token buckets (each bucket is compiled)."""
    llm = LLM(model=DEMO_MODEL, max_num_seqs=16, max_model_len=160, max_num_batched_tokens=128, **kwargs)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)], llm.llm_engine


def test_seeded_sampling_and_logprobs_are_the_same_with_speculation():
    """Every position samples with its own key, so a seeded request's tokens, and the logprobs
    of every token, do not depend on how many were proposed."""
    prompts = KJV * 4
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, seed=i, max_tokens=32, ignore_eos=True, logprobs=2)
        for i, (t, k, p) in enumerate([(0.3, 0, 1.0), (0.7, 20, 1.0), (1.0, 0, 0.8), (0.5, 0, 1.0)] * 3)
    ]
    plain, _ = run_demo(prompts, params)
    spec, engine = run_demo(prompts, params, speculative_config=NGRAM)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    for a, b in zip(spec, plain):  # each token's own logprob (top-2 sets may swap near-ties in bfloat16)
        ours = [la[t].logprob for la, t in zip(a.logprobs, a.token_ids)]
        theirs = [lb[t].logprob for lb, t in zip(b.logprobs, b.token_ids)]
        np.testing.assert_allclose(ours, theirs, atol=BF16_LOGPROB_ATOL)
        assert all(len(la) >= 2 for la in a.logprobs)


@pytest.fixture(scope="module")
def demo_draft(tmp_path_factory) -> str:
    """A draft for the demo model: the demo model with noise on every matrix (the same
    vocabulary; it agrees with the demo model often, not always)."""
    import torch
    import transformers

    path = str(tmp_path_factory.mktemp("demo_draft"))
    model = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL, torch_dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2:
                param.add_(0.3 * param.float().std() * torch.randn(param.shape, generator=generator).to(param.dtype))
    model.save_pretrained(path, safe_serialization=True)
    return path


def methods(demo_draft: str) -> dict:
    return {"ngram": NGRAM, "draft": {"model": demo_draft, "num_speculative_tokens": 3, "adaptive": False}}


DISTRIBUTION_PARAMS = [SamplingParams(temperature=0.8, top_k=8, max_tokens=6, ignore_eos=True)] * 300


@pytest.fixture(scope="module")
def plain_distribution() -> list:
    """The plain engine's outputs for the distribution test, run once for both methods (the same
    engine options, seed and requests give the same tokens)."""
    return run_demo(KJV[:1] * 300, DISTRIBUTION_PARAMS)[0]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_sampled_tokens_follow_the_plain_distribution(demo_draft, plain_distribution, method):
    """300 unseeded requests (the engine seed gives each its own) of one prompt: the histograms
    of the 2nd to 6th generated tokens with and without speculation pass a chi-square test of
    homogeneity at about the 0.1% level (and here are equal: each position samples as plain
    decoding does)."""
    plain = plain_distribution
    spec, engine = run_demo(KJV[:1] * 300, DISTRIBUTION_PARAMS, speculative_config=methods(demo_draft)[method])
    assert engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
    for position in range(1, 6):
        a = np.array([o.token_ids[position] for o in plain])
        b = np.array([o.token_ids[position] for o in spec])
        values = np.union1d(a, b)
        table = np.array([[np.sum(a == v) for v in values], [np.sum(b == v) for v in values]], float)
        expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
        chi2 = float(((table - expected) ** 2 / expected).sum())
        dof = max(len(values) - 1, 1)
        assert chi2 < dof + 3.1 * np.sqrt(2 * dof) + 10, (position, chi2, dof)


STOP_PROMPTS = KJV + KJV[:1]
STOPS = [
    SamplingParams(temperature=0, max_tokens=60, stop=["Israel"]),
    SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=48, stop=[", and"]),
    SamplingParams(temperature=0, max_tokens=100, structured_outputs=StructuredOutputsParams(json=SMALL_SCHEMA)),
]


@pytest.fixture(scope="module")
def plain_stops() -> tuple[list, list]:
    """Plain decoding's outputs for the stop-string test, run once for both methods: `STOPS` on
    `STOP_PROMPTS`, and the first prompt's 60 greedy tokens (what its stream must add up to)."""
    plain, _ = run_demo(STOP_PROMPTS, STOPS)
    whole, _ = run_demo(STOP_PROMPTS[:1], [SamplingParams(temperature=0, max_tokens=60)])
    return plain, whole


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stop_strings_max_tokens_and_streaming_match_plain(demo_draft, plain_stops, method):
    """The demo model on King James prompts (real repetition for the lookup; a noisy copy of the
    demo model as the draft): text, finish reasons, max_tokens exactly, and streamed deltas that
    add up to the final output; a JSON-constrained request beside them (its grammar's forced run
    computed first, unsampled, then n-gram tokens the grammar allows; the draft's are not)."""
    prompts = STOP_PROMPTS
    plain, whole = plain_stops
    spec, engine = run_demo(prompts, STOPS, speculative_config=methods(demo_draft)[method])
    for a, b in zip(spec, plain):
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
    assert len(spec[1].token_ids) == 33 and spec[0].finish_reason == "stop"
    assert (
        spec[3].finish_reason == "stop" and json.loads(spec[3].text)["sex"] in SMALL_SCHEMA["properties"]["sex"]["enum"]
    )
    stats = engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"] > 0.2
    engine.add_request(
        "s", prompts[0], SamplingParams(temperature=0, max_tokens=60, output_kind=RequestOutputKind.DELTA)
    )
    text, tokens, steps_with_several = "", [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text
            tokens += out.outputs[0].token_ids
            steps_with_several += len(out.outputs[0].token_ids) > 1
    assert (text, tokens) == (whole[0].text, whole[0].token_ids) and steps_with_several > 0


def test_sequences_opt_out_and_penalties_never_speculate(tiny_dir):
    prompts = repetitive_prompts(4, seed=4)
    for params in (
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, speculate=False),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, min_tokens=16),
    ):
        plain, _ = run(tiny_dir, prompts, [params] * 4, **ENGINES["roomy"])
        spec, engine = run(tiny_dir, prompts, [params] * 4, speculative_config=NGRAM, **ENGINES["roomy"])
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        assert engine.get_stats()["spec_decode_num_drafts"] == 0


def test_tensor_parallel_speculation_gives_the_unsharded_tokens(tmp_path):
    path = str(tmp_path)
    save_hf_model("llama_tp", path)
    prompts = [p + p[:8] for p in tp_workload.prompts()]  # a repeated start: the lookup has matches
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def tokens(n: int, **kwargs):
        options = {**tp_workload.engine_options(path, n), "max_model_len": 64, **kwargs}
        return token_ids_and_stats(LLMEngine(EngineArgs(**options)), prompts, params)

    plain, _ = tokens(1)
    spec, stats = tokens(4, speculative_config=NGRAM)
    # proposals checked on 4 devices (this random model rejects them; acceptance is the same
    # host and sampler code as on one device, tested above)
    assert spec == plain and stats["spec_decode_num_draft_tokens"] > 0


def test_prefix_hits_on_blocks_written_around_rejected_proposals_match_plain():
    """A request whose prompt is an earlier request's prompt and output reads that request's
    cached blocks, written over steps whose rejected proposals' blocks went back to the pool:
    its tokens and logprobs (float32) are plain decoding's. After every step the packer's copy
    of each running sequence's block table is that table."""
    results = {}
    for name, extra in (("plain", {}), ("spec", {"speculative_config": NGRAM})):
        engine = LLMEngine(
            EngineArgs(
                model=DEMO_MODEL, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64, **extra
            )
        )
        prompts = [engine.tokenizer.encode(t) for t in KJV[:2]]
        greedy = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        outputs = {}

        def run_all():
            packer = engine.runner.packer
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out.outputs[0]
                for seq in engine.scheduler.running:
                    slot = engine.runner.input_batch.slot_of(seq.seq_id)
                    if slot is not None and seq.block_table:
                        assert list(packer.tables[slot, : len(seq.block_table)]) == seq.block_table

        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, greedy)
        run_all()
        follow = prompts[1] + list(outputs["1"].token_ids[:90])
        engine.add_request("c", {"prompt_token_ids": follow}, SamplingParams(temperature=0, max_tokens=20, logprobs=0))
        run_all()
        c = outputs["c"]
        results[name] = (
            [list(outputs[k].token_ids) for k in ("0", "1", "c")],
            [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)],
            engine.get_stats(),
        )
    assert results["spec"][0] == results["plain"][0]
    np.testing.assert_allclose(results["spec"][1], results["plain"][1], atol=1e-4)
    stats = results["spec"][2]
    assert (
        stats["prefix_cache_hits"] >= 90
        and stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0
    )


# -- a draft model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, tiny_dir):
    """Another model with the tiny target's vocabulary (other heads, other weights)."""
    path = str(tmp_path_factory.mktemp("draft_model"))
    save_hf_model("llama_mha", path, seed=7)
    return path


def test_draft_model_refusals_name_the_field(tmp_path, tiny_dir):
    save_hf_model("qwen2_tp", str(tmp_path))  # a vocabulary of 500, the target's is 512
    with pytest.raises(EngineArgsError, match=r"vocabulary \(500\) must be the target's \(512\)"):
        EngineConfig.resolve(
            EngineArgs(model=tiny_dir, speculative_config={"model": str(tmp_path), "num_speculative_tokens": 2})
        )
    with pytest.raises(EngineArgsError, match="does not work with the host tier yet"):
        EngineArgs(
            model=tiny_dir, kv_offloading_size=0.01, speculative_config={"model": tiny_dir, "num_speculative_tokens": 2}
        )
    short = tmp_path / "short"
    save_hf_model("llama_mha", str(short))
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    with pytest.raises(EngineArgsError, match=r"the draft model: max_model_len=128: .*64"):
        EngineConfig.resolve(
            EngineArgs(
                model=tiny_dir, max_model_len=128, speculative_config={"model": str(short), "num_speculative_tokens": 2}
            )
        )


@pytest.mark.parametrize("engine", ["roomy", "preempting", "chunked"])
def test_draft_model_gives_plain_greedy_tokens(tiny_dir, draft_dir, engine):
    """Another model's proposals (mostly rejected) and the target's own as the draft (all
    accepted): the target's greedy tokens either way, the draft's pool kept in step through
    prefix hits, chunked prefill and preemption."""
    prompts = repetitive_prompts(12, seed=5)
    params = [
        SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True)
        for m in np.random.default_rng(2).integers(4, 30, size=len(prompts))
    ]
    plain, _ = run(tiny_dir, prompts, params, **ENGINES[engine])
    target_block = 2 * 2 * 2 * 16 * 16 * 4  # bytes of a block: K and V, 2 layers, 2 kv heads of 16, 16 tokens
    for draft, accepted_all, draft_block in ((draft_dir, False, 2 * target_block), (tiny_dir, True, target_block)):
        spec = {"model": draft, "num_speculative_tokens": 3, "adaptive": False}
        options = dict(ENGINES[engine])
        if (
            "kv_cache_memory_bytes" in options
        ):  # 16 blocks (preemptions with these prompts), each with its twin in the draft's pool
            options["kv_cache_memory_bytes"] = 16 * (target_block + draft_block)
        outputs, engine_ = run(tiny_dir, prompts, params, speculative_config=spec, **options)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain], draft
        stats = engine_.get_stats()
        assert stats["spec_decode_num_draft_tokens"] > 0 and stats["num_free_blocks"] == stats["num_total_blocks"]
        if accepted_all:  # the same model proposes exactly what the target samples
            assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
        if engine == "preempting":
            assert stats["num_preemptions"] > 0


def test_draft_model_sampling_keeps_seeded_tokens_and_couples_its_samples(tiny_dir):
    """Seeded sampling: the target's tokens with a draft model; a draft that is the target
    samples with the same per-position keys, so every proposal is accepted even at temperature 1."""
    prompts = repetitive_prompts(6, seed=6)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=20, ignore_eos=True) for i in range(6)]
    plain, _ = run(tiny_dir, prompts, params, **ENGINES["roomy"])
    spec, engine = run(
        tiny_dir,
        prompts,
        params,
        speculative_config={"model": tiny_dir, "num_speculative_tokens": 3, "adaptive": False},
        **ENGINES["roomy"],
    )
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    stats = engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0


def test_tensor_parallel_draft_model_gives_the_unsharded_tokens(tmp_path):
    path, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    save_hf_model("llama_tp", path)
    save_hf_model("llama_tp", draft, seed=3)
    prompts = tp_workload.prompts()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens(n: int, **kwargs):
        options = tp_workload.engine_options(path, n)
        if kwargs:  # the same blocks per device, each with its twin in the (equal-sized) draft's pool
            options["kv_cache_memory_bytes"] *= 2
        return token_ids_and_stats(LLMEngine(EngineArgs(**options, **kwargs)), prompts, params)

    plain, _ = tokens(1)
    for draft_dir_, n in ((draft, 4), (path, 2)):
        spec, stats = tokens(
            n, speculative_config={"model": draft_dir_, "num_speculative_tokens": 2, "adaptive": False}
        )
        assert spec == plain and stats["spec_decode_num_draft_tokens"] > 0 and stats["num_preemptions"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]  # the target as its draft


def count_draft_calls(engine: LLMEngine) -> list[int]:
    """Wraps every compiled program of the engine's draft model to count its calls (one counter)."""
    calls = [0]
    compiled = engine.runner.draft.compiled

    def counting(executable):
        def call(*args):
            calls[0] += 1
            return executable(*args)

        return call

    for program, executable in list(compiled.items()):
        compiled[program] = counting(executable)
    return calls


def test_draft_model_catches_up_after_plain_steps_prefix_hits_and_preemption(tiny_dir):
    """The target as its own draft, with speculation switched off for stretches of steps (fixed
    pattern instead of the governor's timing): a plain step calls none of the draft's programs
    and fuses decode steps; a speculating step's draft first catches up on what it missed
    (prompts, prefix-cache hits, recomputed preemptions, plain steps' tokens), so its
    proposals are all accepted; the tokens are plain greedy decoding's, and the draft holds no
    state for finished sequences."""
    prompts = repetitive_prompts(12, seed=7)
    params = [
        SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True)
        for m in np.random.default_rng(3).integers(8, 40, size=len(prompts))
    ]
    plain, _ = run(tiny_dir, prompts, params, **ENGINES["preempting"])  # greedy tokens do not depend on the pool
    options = dict(ENGINES["preempting"], kv_cache_memory_bytes=16 * 2 * (2 * 2 * 2 * 16 * 16 * 4))
    engine = LLMEngine(
        EngineArgs(
            model=tiny_dir,
            dtype="float32",
            max_model_len=128,
            **options,
            speculative_config={"model": tiny_dir, "num_speculative_tokens": 3},
        )
    )
    assert engine.runner.async_scheduling and engine.scheduler.config.num_scheduler_steps == 4
    pattern = iter(range(10**6))
    engine.governor.speculate = lambda running: next(pattern) % 7 < 3  # 3 steps on, 4 off
    calls = count_draft_calls(engine)
    schedule, outputs = engine.scheduler.schedule, []
    engine.scheduler.schedule = lambda propose, **kw: outputs.append(schedule(propose, **kw)) or outputs[-1]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    done, plain_steps = {}, []
    while engine.has_unfinished_requests():
        before = calls[0]
        done.update((int(o.request_id), o.outputs[0]) for o in engine.step() if o.finished)
        if not any(outputs[-1].drafting):
            plain_steps.append((outputs[-1].num_steps, calls[0] - before))
    assert all(n == 0 for _, n in plain_steps) and any(steps > 1 for steps, _ in plain_steps)
    assert [done[i].token_ids for i in range(len(prompts))] == [o.token_ids for o in plain]
    stats = engine.get_stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert calls[0] > 0
    engine.step()  # the next schedule releases the last finished sequences
    assert engine.runner.draft._held == {} and stats["num_free_blocks"] == stats["num_total_blocks"]
