"""The pipelined engine (pipeline parallelism): every step is one pipeline tick that carries the
micro-batches in flight to the next step (`PipelinedRunner`), the scheduler keeps a sequence in
one micro-batch in flight at most and splits the decoding sequences into P groups, so the stages
stay busy; the tokens are transformers', and every sampler input (penalties, logprobs, prompt
logprobs, token masks, seeds) follows its micro-batch out of the pipeline.
"""

import numpy as np
import pytest
from engine_fixtures import hf_greedy
from tiny_models import save_hf_model

from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from jaxpaged.core.sequence import Sequence
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.model.sampler import SamplerOptions
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.pipeline_feed import CarryKey, MicroBatch, PipelineFeed

MAX_TOKENS = 12
PROMPTS = [[5 + i, 6, 7 + 2 * i, 8, 9] + [40 + i] * i for i in range(8)]


def micro_batch(key: CarryKey, *seq_ids: int) -> MicroBatch:
    return MicroBatch(key, False, SamplerOptions(), None, seq_ids=frozenset(seq_ids))


def test_feed_returns_each_micro_batch_p_minus_1_ticks_later_and_drains_before_another_shape():
    decode, ragged = CarryKey(16, True), CarryKey(16, False)
    feed = PipelineFeed(stages=3)
    a, b, c = micro_batch(decode, 1, 2), micro_batch(decode, 3), micro_batch(decode, 4)
    assert feed.advance(a) is None and feed.advance(b) is None  # filling
    assert feed.seq_ids() == {1, 2, 3} and feed.leaving() is a
    assert feed.must_drain_for(ragged) and not feed.must_drain_for(decode)
    assert feed.advance(c) is a and feed.advance(None) is b and feed.busy
    assert feed.advance(None) is c and not feed.busy  # drained: any shape may enter now
    assert not feed.must_drain_for(ragged) and feed.leaving() is None


def test_scheduler_passes_over_sequences_in_flight_and_decodes_a_pth_of_the_running():
    config = SchedulerConfig(max_model_len=64, num_blocks=64, block_size=4, pipeline_depth=2)
    scheduler = Scheduler(config)
    seqs = [Sequence(str(i), [3, 4, 5], SamplingParams(max_tokens=8)) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    prefill = scheduler.schedule()
    assert len(prefill.scheduled) == 5  # admitting is not capped
    scheduler.postprocess(prefill, [[7]] * 5, {})
    first = scheduler.schedule()
    assert [s.seq_id for s, _ in first.scheduled] == [s.seq_id for s in seqs[:3]]  # ceil(5 / 2)
    in_flight = frozenset(s.seq_id for s, _ in first.scheduled)
    second = scheduler.schedule(in_flight=in_flight)
    assert [s.seq_id for s, _ in second.scheduled] == [s.seq_id for s in seqs[3:]]
    both = in_flight | {s.seq_id for s, _ in second.scheduled}
    assert scheduler.schedule(in_flight=both).is_empty  # everyone in flight: the tick feeds nothing


@pytest.fixture(scope="module")
def pp_model(tmp_path_factory):
    """(model dir, its transformers model): 5 layers (2 stages: 3 + 2; 4 stages: 2 + 1 + 1 + 1)."""
    path = str(tmp_path_factory.mktemp("llama_pp"))
    return path, save_hf_model("llama_pp", path)


def engine(path: str, tp: int, pp: int, **options) -> LLMEngine:
    args = dict(model=path, dtype="float32", skip_tokenizer_init=True, max_model_len=64, block_size=4)
    args |= dict(tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_seqs=8, max_num_batched_tokens=64)
    return LLMEngine(EngineArgs(**(args | options)))


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((int(o.request_id), o) for o in engine.step() if o.finished)
    assert not engine.runner.busy
    return [done[i] for i in range(len(requests))]


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 4)])
def test_decoding_groups_keep_every_stage_busy_and_give_transformers_tokens(pp_model, tp, pp):
    """8 sequences decoding over P stages: P groups take turns, so once the prompts are in, every
    stage works at every tick (the in-step pipeline idled (P - 1) / P of a decode step)."""
    path, hf = pp_model
    eng = engine(path, tp, pp)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = run(eng, [(p, greedy) for p in PROMPTS])
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    runner = eng.runner
    # The ticks that idle a stage: filling (P - 1 after the prompts' step and after the drain
    # that lets the decodes' shape in) and the final drain, a few per shape change.
    idle_ticks = runner.num_ticks * pp - runner.busy_stage_ticks
    decode_ticks = len(PROMPTS) * (MAX_TOKENS - 1) / -(-len(PROMPTS) // pp)
    assert runner.bubble < 0.5 * (pp - 1) / pp, (runner.bubble, runner.num_ticks, idle_ticks)
    assert runner.num_ticks < 1.5 * decode_ticks + 4 * pp
    assert eng.get_stats()["num_free_blocks"] == eng.get_stats()["num_total_blocks"]


def test_pausing_drains_the_pipeline_and_resuming_goes_on(pp_model):
    """`pause_generation("keep")` mid-decode: the micro-batches in flight leave (a step loop
    ends), and after `resume_generation` the requests finish with transformers' tokens."""
    path, hf = pp_model
    eng = engine(path, 1, 2)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), {"prompt_token_ids": p}, greedy)
    done = {}
    for _ in range(6):
        done.update((int(o.request_id), o) for o in eng.step() if o.finished)
    assert eng.runner.in_flight_seq_ids
    eng.pause_generation("keep")
    while eng.has_unfinished_requests():
        eng.step()
    assert not eng.runner.busy and eng.scheduler.num_running == len(PROMPTS)
    eng.resume_generation()
    while eng.has_unfinished_requests():
        done.update((int(o.request_id), o) for o in eng.step() if o.finished)
    assert [done[i].outputs[0].token_ids for i in range(len(PROMPTS))] == [
        hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS
    ]


@pytest.fixture(scope="module")
def one_and_staged(pp_model) -> tuple[LLMEngine, LLMEngine]:
    """An engine on one device and one at PP 2 with a host tier (its copies drain the pipeline),
    room for 40 sequences (token buckets 16, 32 and 64)."""
    path, _ = pp_model
    options = dict(max_num_batched_tokens=64, max_num_seqs=40)
    return engine(path, 1, 1, **options), engine(path, 1, 2, kv_offloading_size=2**-14, **options)


def test_sampler_inputs_leave_with_their_micro_batch(one_and_staged):
    """Seeded sampling with penalties, logprobs, prompt logprobs and token masks
    (`allowed_token_ids`) at PP 2 gives what one device gives, request by request."""
    allowed = list(range(100, 164))
    kinds = [
        dict(temperature=1.0, seed=3, repetition_penalty=1.3, frequency_penalty=0.5, logprobs=2),
        dict(temperature=0.7, top_p=0.8, top_k=20, seed=11),
        dict(temperature=1.0, seed=5, allowed_token_ids=allowed),
        dict(temperature=0, prompt_logprobs=1, presence_penalty=1.0),
    ]
    requests = [
        (p, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kinds[i % 4])) for i, p in enumerate(PROMPTS)
    ]
    one, staged = (run(eng, requests) for eng in one_and_staged)
    for a, b in zip(one, staged):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.request_id
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or []):
            assert x.keys() == y.keys()
            np.testing.assert_allclose([p.logprob for p in x.values()], [p.logprob for p in y.values()], atol=1e-4)
        if a.prompt_logprobs is not None:
            got = [next(iter(d.values())).logprob for d in b.prompt_logprobs[1:]]
            want = [next(iter(d.values())).logprob for d in a.prompt_logprobs[1:]]
            np.testing.assert_allclose(got, want, atol=1e-4)
    assert set(staged[2].outputs[0].token_ids) <= set(allowed)


def test_a_prompts_chunks_follow_one_another_tick_by_tick(pp_model):
    """One 60-token prompt in chunks of 16 at PP 2: its 4 chunks enter at 4 ticks in a row (a
    chunk that samples nothing needs no token), then each of its 3 more tokens takes P ticks."""
    path, hf = pp_model
    eng = engine(path, 1, 2, max_num_batched_tokens=16, enable_prefix_caching=False)
    prompt = [(7 * i) % 400 + 3 for i in range(60)]
    (out,) = run(eng, [(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))])
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 4)
    assert eng.runner.num_ticks == 4 + (2 - 1) + 3 * 2


def test_aborts_in_flight_and_mixed_requests_give_one_devices_outputs(pp_model, one_and_staged):
    """PP 2 with a host tier, prompts in chunks. Requests aborted while their micro-batch is
    in flight (a prompt chunk that samples nothing, or a decode token) give their runner slots and
    blocks to requests that arrive then (seeded, penalties, logprobs; the same prompts, so prefix
    hits on blocks still being written); beside them n > 1, min_tokens and max_tokens=1. Every
    request not aborted gets what one device gives. Then 33 sequences decode in groups of 17 and
    16 (token buckets 32 and 16): the 16 ride in the carry's bucket instead of draining it."""
    path, hf = pp_model
    prompts = [[(7 * i + 3 * j) % 400 + 3 for i in range(50)] for j in range(3)]

    def sampled(seed: int, **kw) -> SamplingParams:
        options = dict(temperature=1.0, seed=seed, max_tokens=8, ignore_eos=True)
        return SamplingParams(**(options | dict(frequency_penalty=1.5, repetition_penalty=1.3, logprobs=1) | kw))

    first = [(f"chunk{j}", p, sampled(10 + j)) for j, p in enumerate(prompts)]  # aborted mid-prompt
    first += [(f"decode{j}", p[:6], sampled(20 + j, max_tokens=30)) for j, p in enumerate(prompts)]
    first += [
        ("n3", PROMPTS[1], sampled(4, n=3, max_tokens=9)),
        ("min", PROMPTS[2], sampled(5, min_tokens=6, ignore_eos=False, stop_token_ids=list(range(3, 500, 40)))),
        ("one", PROMPTS[3], SamplingParams(temperature=0, max_tokens=1)),
    ]
    events = {  # step -> (requests aborted, requests added) after it
        2: ([f"chunk{j}" for j in range(3)], [(f"again{j}", p, sampled(j)) for j, p in enumerate(prompts)]),
        9: ([f"decode{j}" for j in range(3)], [(f"after{j}", p[:6], sampled(30 + j)) for j, p in enumerate(prompts)]),
    }

    def drive(eng: LLMEngine, pipelined: bool) -> dict:
        for request_id, prompt, params in first:
            eng.add_request(request_id, {"prompt_token_ids": prompt}, params)
        done, steps = {}, 0
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
            steps += 1
            aborted, added = events.get(steps, ([], []))
            if aborted and pipelined:  # (a sampled token in flight; at step 2 a chunk may be)
                assert steps == 2 or {s.seq_id for s in eng._seqs[aborted[0]]} & eng.runner.in_flight_seq_ids
            eng.abort_request(aborted)
            for request_id, prompt, params in added:
                eng.add_request(request_id, {"prompt_token_ids": prompt}, params)
        assert not eng.runner.in_flight_seq_ids
        stats = eng.get_stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        return done

    one, staged = one_and_staged
    hits = staged.get_stats()["prefix_cache_hits"]
    want, got = drive(one, False), drive(staged, True)
    assert staged.get_stats()["prefix_cache_hits"] > hits
    assert got.keys() == want.keys()
    for request_id, out in got.items():
        if request_id.startswith(("chunk", "decode")):
            assert out.outputs[0].finish_reason == "abort", request_id
            continue
        for a, b in zip(want[request_id].outputs, out.outputs, strict=True):
            assert (a.token_ids, a.finish_reason) == (b.token_ids, b.finish_reason), request_id
            for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
                assert x.keys() == y.keys()
                np.testing.assert_allclose([p.logprob for p in x.values()], [p.logprob for p in y.values()], atol=1e-4)

    runner, many = staged.runner, [[5 + i, 6 + i % 7, 8] for i in range(33)]
    drains = runner.num_drain_ticks
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = run(staged, [(p, greedy) for p in many])
    assert [o.outputs[0].token_ids for o in outputs[:2]] == [hf_greedy(hf, p, 8) for p in many[:2]]
    assert runner.num_drain_ticks - drains <= 4, runner.num_drain_ticks - drains
