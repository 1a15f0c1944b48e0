"""The runner's input batch (numpy only): slots taken by admitted sequences and given back by
released ones, penalty rows reset or seeded, banned ids, and the sampler options of a step."""

import pytest

from jaxpaged.core.step_inputs import ScheduledSequence
from jaxpaged.model.sampler import SamplerOptions
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.input_batch import InputBatch
from jaxpaged.worker.step_packer import StepPacker, token_buckets


def entry(seq_id, admitted=False, prefix=None, **params):
    return ScheduledSequence(
        [5],
        3,
        [1],
        seq_id=seq_id,
        params=SamplingParams(**params),
        prompt_len=3,
        admitted=admitted,
        prefix_token_ids=prefix,
    )


def test_slots_follow_admissions_and_releases():
    packer = StepPacker(block_size=4, max_model_len=16, max_num_seqs=2, max_num_batched_tokens=16, vocab_size=32)
    batch = InputBatch(packer, 2, frozenset({1}))
    step = batch.prepare([entry(10, admitted=True), entry(11, admitted=True, prefix=[7, 8, 9], presence_penalty=0.5)])
    assert [r.slot for r in step.rows] == [0, 1] and step.resets == [0] and step.seeds == [(1, [7, 8, 9], 3)]
    assert step.options == SamplerOptions() and batch.num_free_slots == 0
    step = batch.prepare([entry(10), entry(11, top_p=0.5)])
    assert [r.slot for r in step.rows] == [0, 1] and not step.resets and not step.seeds
    assert step.options == SamplerOptions(filter=True, logprobs=True)  # one sampler takes both paths
    assert batch.prepare([entry(10), entry(11, logprobs=0)]).options == SamplerOptions()  # the chosen token's only
    batch.release([10, 99])  # finished (99: never had a slot)
    assert batch.num_free_slots == 1 and batch.slot_of(10) is None
    step = batch.prepare([entry(12, admitted=True, min_tokens=2, stop_token_ids=[4])])
    assert step.rows[0].slot == 0 and step.rows[0].banned_ids == (1, 4)  # EOS and the stop ids, before min_tokens
    with pytest.raises(RuntimeError, match="holds no slot"):
        batch.prepare([entry(13)])


def test_token_buckets_add_three_quarter_points_where_steps_are_sequences():
    assert token_buckets(2048, 256) == [16, 32, 64, 128, 256, 512, 1024, 2048]  # nothing within 256 sequences
    # vLLM's GPU limits: 384 and 768 between the powers a decode step of 257-1,024 sequences uses
    assert token_buckets(16384, 1024) == [16, 32, 64, 128, 256, 384, 512, 768, 1024, 2048, 4096, 8192, 16384]
    assert token_buckets(300, 1024)[-1] == 384 and token_buckets(700, 700)[-2:] == [512, 1024]
    packer = StepPacker(block_size=16, max_model_len=64, max_num_seqs=1024, max_num_batched_tokens=16384, vocab_size=32)
    assert packer.bucket_for(300, 300) == 384 and packer.layouts[384].num_seqs == 384
    assert packer.bucket_for(700, 700) == 768 and packer.bucket_for(1500, 1024) == 2048
