"""Structured outputs, allowed_token_ids and bad_words on the demo model: every constrained output
obeys its constraint (JSON schema, regex, choice, Lark grammar), greedy and sampled, n > 1, with
prefix-cache hits, under preemption and under tensor parallelism; with grammar speculation
(forced tokens and n-gram proposals checked against the grammar) the outputs are the plain
engine's, token for token; so are they when decodes compute the tokens their constraint forces
without sampling them; a grammar that fails (unreadable, allowing nothing, given up on mid-generation) fails
its request with an error naming the field, and the engine goes on; with
async scheduling (masks filled while the step's model program runs) the outputs are the
synchronous engine's, token for token. (The masked distribution itself: tests/test_sampler_mask.py.)"""

import re
import time

import numpy as np
import pytest
from structured_workload import CONSTRAINTS, obeys

from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.sampling_params import SamplingParams, StructuredOutputsParams

DEMO_MODEL = "jaxpaged/demo_model"
PROMPT = (  # a few full KV blocks, so a second request reuses them from the prefix cache
    "And the LORD spake unto Moses, saying, Speak unto the children of Israel, and say unto them, "
    "When ye be come into the land which I give unto you, then shall the land keep a sabbath unto the LORD."
)
BLOCK_BYTES = 2 * 4 * 2 * 64 * 4 * 16  # K and V, 4 layers, 2 kv heads, head_dim 64, float32, 16 tokens


def make_engine(**kwargs) -> LLMEngine:
    start = time.perf_counter()
    options = dict(model=DEMO_MODEL, dtype="float32", max_num_seqs=8, max_model_len=384, max_num_batched_tokens=64)
    engine = LLMEngine(EngineArgs(**{**options, **kwargs}))
    print(f"engine {kwargs} started in {time.perf_counter() - start:.1f} s")
    return engine


def run(engine: LLMEngine, requests: list[tuple[str, SamplingParams]]) -> dict[str, list]:
    """Runs `(request_id, params)` requests on PROMPT; returns each request's completions."""
    start = time.perf_counter()
    for request_id, params in requests:
        engine.add_request(request_id, PROMPT, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs) for o in engine.step() if o.finished)
    print(f"{len(requests)} requests in {time.perf_counter() - start:.1f} s")
    return done


def constrained_requests(tag: str, n: int = 2) -> list[tuple[str, SamplingParams]]:
    """Each constraint greedy and sampled (n completions, seeded)."""
    out = []
    for kind, so in CONSTRAINTS.items():
        out.append((f"{tag}-{kind}-greedy", SamplingParams(temperature=0, max_tokens=300, structured_outputs=so)))
        sampled = SamplingParams(temperature=1.0, n=n, seed=7, max_tokens=300, structured_outputs=so)
        out.append((f"{tag}-{kind}-sampled", sampled))
    return out


def check_all_obey(done: dict[str, list]) -> None:
    for request_id, completions in done.items():
        kind = request_id.split("-")[1]
        if kind not in CONSTRAINTS:
            continue
        for c in completions:
            assert c.finish_reason == "stop", (request_id, c.text, c.finish_reason)
            assert obeys(kind, c.text), (request_id, c.text)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine()  # fused decode steps and async scheduling on (the defaults)


def test_every_output_obeys_its_constraint_with_prefix_hits(engine):
    plain = ("free-text", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    first = run(engine, constrained_requests("a") + [plain])
    check_all_obey(first)
    assert first["free-text"][0].finish_reason == "length"  # unconstrained rows beside them are untouched
    hits = engine.get_stats()["prefix_cache_hits"]
    again = run(engine, constrained_requests("b"))
    check_all_obey(again)
    assert engine.get_stats()["prefix_cache_hits"] > hits
    for kind in CONSTRAINTS:  # greedy is deterministic, whatever the batch
        assert again[f"b-{kind}-greedy"][0].token_ids == first[f"a-{kind}-greedy"][0].token_ids


def test_running_out_of_max_tokens_is_length(engine):
    params = SamplingParams(temperature=0, max_tokens=3, structured_outputs=CONSTRAINTS["json"])
    (c,) = run(engine, [("short", params)])["short"]
    assert c.finish_reason == "length" and len(c.token_ids) == 3


def test_no_constraint_ends_in_part_of_a_character(engine):
    """Constraints whose language holds characters of several UTF-8 bytes (any character, a
    word class, accented and CJK choices, a JSON string), sampled hot: every completion stops
    where its constraint accepts, with whole characters only (no U+FFFD from a cut sequence);
    `\\w` and `\\d` are ASCII (issue 45)."""
    constraints = {
        "any": StructuredOutputsParams(regex=".{4}"),
        "word": StructuredOutputsParams(regex=r"\w{3}-\d{3}"),
        "choice": StructuredOutputsParams(choice=["café", "日本語", "naïve ☃"]),
        "string": StructuredOutputsParams(json={"type": "string", "minLength": 2, "maxLength": 5}),
    }
    requests = [
        (kind, SamplingParams(temperature=1.5, n=4, seed=11, max_tokens=40, structured_outputs=so))
        for kind, so in constraints.items()
    ]
    done = run(engine, requests)
    for kind, completions in done.items():
        for c in completions:
            assert c.finish_reason == "stop" and "\ufffd" not in c.text, (kind, c.text)
    assert all(re.fullmatch(r"[0-9A-Za-z_]{3}-[0-9]{3}", c.text) for c in done["word"]), done["word"]
    assert all(c.text in ("café", "日本語", "naïve ☃") for c in done["choice"])


def test_allowed_token_ids_and_bad_words(engine):
    allowed = list(range(100, 140))
    free = run(engine, [("free", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))])["free"][0]
    word = engine.tokenizer.decode(free.token_ids[2:4]).strip()  # a word greedy decoding does say
    params = [
        ("allowed", SamplingParams(temperature=1.0, seed=3, max_tokens=16, allowed_token_ids=allowed)),
        ("bad", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[word])),
    ]
    done = run(engine, params)
    assert set(done["allowed"][0].token_ids) <= set(allowed)
    assert word not in done["bad"][0].text and done["bad"][0].token_ids != free.token_ids


def test_failed_grammars_fail_their_request_and_the_engine_serves_on(engine):
    """A grammar that cannot be read, that allows no output (a `$ref` cycle) or that llguidance
    gives up on mid-generation (600 optional properties: a row of more than its 2,000 Earley
    items once the object opens) fails its request alone: finish_reason "error", empty text, an
    `invalid_request_error` naming the field, nothing of the grammar quoted; a bad
    allowed_token_ids is a ValueError at once; the engine serves on, and the grammars that
    compiled are cached."""
    cycle = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
    bad = {
        "regex": (StructuredOutputsParams(regex="a[b"), "structured_outputs.regex:"),
        "json": (StructuredOutputsParams(json='{"type": 5}'), "structured_outputs.json:"),
        "cycle": (StructuredOutputsParams(json=cycle), "structured_outputs.json: the grammar allows no output"),
        "wide": (StructuredOutputsParams(json=wide), "structured_outputs: the grammar could not continue after"),
    }
    with pytest.raises(ValueError) as err:
        engine.add_request("bad-allowed", PROMPT, SamplingParams(allowed_token_ids=[1, 10**6]))
    assert str(err.value).startswith("allowed_token_ids")
    requests = [
        (f"bad-{name}", SamplingParams(n=2, max_tokens=20, structured_outputs=so)) for name, (so, _) in bad.items()
    ]
    requests.append(("c-choice-ok", SamplingParams(structured_outputs=CONSTRAINTS["choice"])))
    for request_id, params in requests:
        engine.add_request(request_id, PROMPT, params)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    for name, (_, message) in bad.items():
        out = outputs[f"bad-{name}"]
        assert out.error.startswith(message) and out.error_type == "invalid_request_error", out.error
        assert len(out.error) < 400 and "\n" not in out.error
        assert [(c.finish_reason, c.text) for c in out.outputs] == [("error", "")] * 2
    check_all_obey({"c-choice-ok": outputs["c-choice-ok"].outputs})
    compiles = engine.grammars.compiles
    run(engine, [("again", SamplingParams(max_tokens=20, structured_outputs=bad["wide"][0]))])
    assert engine.grammars.compiles == compiles  # the same schema: its compiled grammar again


def test_grammar_speculation_gives_the_plain_tokens_under_preemption_and_prefix_hits(engine):
    """Constrained rows compute the tokens their constraint forces (unsampled, in the step) and
    then check the n-gram proposals the grammar allows, each position sampled under its own mask:
    greedy and seeded outputs are the plain engine's, token for token, also when preempted and on
    prefix-cache hits. Forced tokens are not proposals: the spec-decode counters leave them out."""
    spec = make_engine(
        kv_cache_memory_bytes=40 * BLOCK_BYTES,
        num_scheduler_steps=1,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    )
    requests = constrained_requests("s", n=3) + [
        ("free-greedy", SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)),  # repeats itself
        ("x-allowed", SamplingParams(temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=list(range(100, 140)))),
        ("x-bad", SamplingParams(temperature=0.6, seed=2, max_tokens=24, ignore_eos=True, bad_words=["the", "LORD"])),
    ]
    tokens = lambda done: {rid: [c.token_ids for c in cs] for rid, cs in done.items()}  # noqa: E731
    plain = tokens(run(engine, requests))
    entries = []  # per scheduled decode: (request, forced tokens, proposals)
    execute = spec.runner.execute

    def record(o):
        for (seq, _), f, d in zip(o.scheduled[: o.num_decode_seqs], o.forced or [[]] * o.num_seqs, o.drafts):
            entries.append((seq.request_id, len(f), len(d)))
        return execute(o)

    spec.runner.execute = record
    first = run(spec, requests)
    spec.runner.execute = execute
    check_all_obey(first)
    assert tokens(first) == plain
    stats = spec.get_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    forced, drafted = np.sum([(f, d) for _, f, d in entries], axis=0)
    assert stats["spec_decode_num_draft_tokens"] == drafted  # forced tokens are not proposals
    json_tokens = sum(len(c.token_ids) for c in first["s-json-greedy"] + first["s-json-sampled"])
    assert forced > json_tokens / 2  # most of a schema's tokens are forced: computed unsampled
    # a forced run and proposals after it in one step, for the greedy JSON request among others;
    # its steps: fewer than half its tokens
    assert any(f and d for _, f, d in entries)
    steps = sum(rid == "s-json-greedy" for rid, _, _ in entries)
    assert steps < len(first["s-json-greedy"][0].token_ids) / 2, (steps, entries)
    hits = stats["prefix_cache_hits"]
    assert tokens(run(spec, requests)) == plain
    assert spec.get_stats()["prefix_cache_hits"] > hits


def test_forced_tokens_give_the_plain_tokens_in_fewer_steps(engine, monkeypatch):
    """Decodes compute the tokens their constraint allows alone (a schema's keys and punctuation)
    as query tokens without sampling them: outputs (and logprobs, whose requests sample every
    token) are those of the engine sampling every token, token for token, in fewer steps."""
    json = CONSTRAINTS["json"]
    with_logprobs = SamplingParams(temperature=0.7, seed=9, max_tokens=300, logprobs=2, structured_outputs=json)
    requests = constrained_requests("f", n=2) + [("f-json-logprobs", with_logprobs)]
    outputs, logprobs, steps = [], [], []
    for forcing in (False, True):
        decodes = []  # per step: (decoding sequences, forced tokens)
        execute = engine.runner.execute
        count = lambda o: (decodes.append((o.num_decode_seqs, o.num_forced_tokens)), execute(o))[1]  # noqa: E731
        monkeypatch.setattr(engine.runner, "execute", count)
        if not forcing:  # every token sampled, one step each
            monkeypatch.setattr(engine.scheduler, "_add_forced", lambda scheduled, forced, budget: budget)
        done = run(engine, requests)
        monkeypatch.undo()
        check_all_obey(done)
        outputs.append({rid: [(c.token_ids, c.text) for c in cs] for rid, cs in done.items()})
        top = [(t, p.logprob) for position in done["f-json-logprobs"][0].logprobs for t, p in position.items()]
        logprobs.append(top)
        steps.append(np.sum(decodes, axis=0))  # sequence-steps of decoding, forced tokens
    assert outputs[1] == outputs[0]
    # (its batch's programs differ: the logprobs agree to float32 rounding)
    assert [t for t, _ in logprobs[1]] == [t for t, _ in logprobs[0]]
    assert [p for _, p in logprobs[1]] == pytest.approx([p for _, p in logprobs[0]], abs=1e-4)
    assert steps[0][1] == 0 and steps[1][1] > 0
    assert steps[1][0] < 0.75 * steps[0][0], steps  # most of a schema's tokens are forced


@pytest.mark.parametrize(
    "options",
    # 28 blocks: the JSON requests preempt each other whenever their grammars' compiles (on
    # their own threads) let them in (40 left it to timing: none under CI's load)
    [dict(), dict(kv_cache_memory_bytes=28 * BLOCK_BYTES, num_scheduler_steps=1)],
    ids=["fused-default", "preempt"],
)
def test_overlapped_masks_equal_synchronous_steps(options):
    """Async scheduling dispatches a masked step's model program, then fills its masks and
    dispatches its sampler (the previous step's tokens having advanced the matchers): the outputs
    are the synchronous engine's, token for token, constrained rows beside unconstrained ones.
    By default, while grammars run, the step in flight is read before the next is scheduled;
    the preempting case overlaps those steps too (their forced runs cut in two)."""
    sync, overlapped = make_engine(async_scheduling=False, **options), make_engine(**options)
    overlapped.runner.read_first_under_grammars = "kv_cache_memory_bytes" not in options
    deferred = []
    dispatch = overlapped.runner.dispatch_sampler
    overlapped.runner.dispatch_sampler = lambda handle: (deferred.append(handle.pending is not None), dispatch(handle))
    word = "the"
    requests = constrained_requests("o", n=3) + [
        ("free-greedy", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)),
        ("free-sampled", SamplingParams(temperature=0.9, n=2, seed=5, max_tokens=30)),
        ("x-allowed", SamplingParams(temperature=1.0, seed=3, max_tokens=12, allowed_token_ids=list(range(100, 140)))),
        ("x-bad", SamplingParams(temperature=0.8, seed=4, max_tokens=24, bad_words=[word, "LORD unto"])),
    ]
    runs = [run(engine, requests) for engine in (sync, overlapped)]
    check_all_obey(runs[1])
    outputs = [{rid: [(c.token_ids, c.text, c.finish_reason) for c in cs] for rid, cs in r.items()} for r in runs]
    assert outputs[1] == outputs[0]
    assert any(deferred)  # masks were filled after the model programs were dispatched
    if "kv_cache_memory_bytes" in options:
        assert overlapped.get_stats()["num_preemptions"] > 0


def test_valid_under_tensor_parallelism():
    engine = make_engine(tensor_parallel_size=2, num_scheduler_steps=1)
    check_all_obey(run(engine, constrained_requests("t")))


def test_pipeline_parallelism_gives_the_same_constrained_outputs(engine):
    """Two stages: each micro-batch's masks are filled when it leaves the last stage (its
    sequences' previous tokens came back before), forced runs included; with stop strings beside
    them, the outputs are one device's, token for token."""
    staged = make_engine(pipeline_parallel_size=2)
    requests = constrained_requests("p")
    # Stop strings finish sequences whose next micro-batch is in flight (n > 1: one sample of two).
    stops = [["e", "th"], ["a"], [" the "]]
    for i, stop in enumerate(stops):
        params = SamplingParams(
            temperature=0.8, seed=i, n=2, max_tokens=40, stop=stop, include_stop_str_in_output=i == 1
        )
        requests.append((f"p-stop{i}", params))
    want, got = run(engine, requests), run(staged, requests)
    check_all_obey(got)
    assert {r: [(c.token_ids, c.text, c.finish_reason) for c in cs] for r, cs in got.items()} == {
        r: [(c.token_ids, c.text, c.finish_reason) for c in cs] for r, cs in want.items()
    }
    assert any(c.finish_reason == "stop" for i in range(len(stops)) for c in got[f"p-stop{i}"])
    assert staged.runner.bubble < 0.5
