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
    assert not engine.runner.in_flight_seq_ids
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
    assert not eng.runner.in_flight_seq_ids and eng.scheduler.num_running == len(PROMPTS)
    eng.resume_generation()
    while eng.has_unfinished_requests():
        done.update((int(o.request_id), o) for o in eng.step() if o.finished)
    assert [done[i].outputs[0].token_ids for i in range(len(PROMPTS))] == [
        hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS
    ]


def test_sampler_inputs_leave_with_their_micro_batch(pp_model):
    """Seeded sampling with penalties, logprobs, prompt logprobs and token masks
    (`allowed_token_ids`) at PP 2 gives what one device gives, request by request."""
    path, _ = pp_model
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
    one, staged = run(engine(path, 1, 1), requests), run(engine(path, 1, 2), requests)
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
