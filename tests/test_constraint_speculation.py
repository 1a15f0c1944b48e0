"""Speculation for constrained sequences on the host (no model): a JSON schema's forced run comes
before the proposals (computed unsampled, not proposed), n-gram proposals after it are cut at
the first token the grammar rejects, and each proposal position gets the mask the grammar has
after the proposals before it, the matcher left as it was.
(Engine outputs with grammar speculation: tests/test_structured_outputs.py.)"""

import llguidance.numpy
import numpy as np
import pytest
from structured_workload import SCHEMA
from transformers import AutoTokenizer

from jaxpaged.config.speculative import SpeculativeConfig
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from jaxpaged.core.sequence import Sequence
from jaxpaged.core.speculation import NgramProposer
from jaxpaged.sampling_params import SamplingParams, StructuredOutputsParams
from jaxpaged.structured import GrammarBackend, SequenceConstraint, fill_bitmask

VOCAB = 4096  # the demo model's


@pytest.fixture(scope="module")
def grammar():
    tokenizer = AutoTokenizer.from_pretrained("jaxpaged/demo_model")
    backend = GrammarBackend(tokenizer, VOCAB, [tokenizer.eos_token_id])
    so = StructuredOutputsParams(json=SCHEMA)
    yield tokenizer, backend, so, backend.compile(so)
    backend.close()


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def write(scheduler: Scheduler, tokens: list[int]) -> None:
    """Steps a one-sequence scheduler (synchronously) until `tokens` are its output: each step
    gains its forced tokens (which must be the next of `tokens`) and the sampled one."""
    while tokens:
        output = scheduler.schedule(propose=False)
        forced = output.forced[0] if output.forced else []
        assert tokens[: len(forced)] == forced
        scheduler.postprocess(output, [tokens[len(forced)]])
        tokens = tokens[len(forced) + 1 :]


def test_forced_then_ngram_proposals_stop_at_the_first_the_grammar_rejects(grammar):
    tokenizer, backend, so, compiled = grammar
    seq = Sequence("r", encode(tokenizer, "Moses"), SamplingParams(max_tokens=100, structured_outputs=so))
    seq.constraint = SequenceConstraint(VOCAB, compiled, backend.valid_ids)
    reference = compiled.result().deep_copy()
    written = encode(tokenizer, '{"patient":"Moses"')
    assert reference.consume_tokens(written)
    forced = reference.compute_ff_tokens()  # ,"age":
    assert tokenizer.decode(forced) == ',"age":'
    # Earlier in the prompt the forced tokens were followed by an age, then a brace the schema
    # does not allow yet (the other fields are required).
    age, brace = encode(tokenizer, "42"), encode(tokenizer, "}")
    seq.prompt_token_ids += forced + age + brace + encode(tokenizer, "Moses")
    config = SchedulerConfig(max_model_len=256, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    k = len(forced) + len(age) + 2
    proposer = NgramProposer(SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": k}))
    scheduler = Scheduler(config, proposer=proposer)
    scheduler.add(seq)
    write(scheduler, written)
    output = scheduler.schedule()
    # the forced run first (computed unsampled, not proposals), then the n-gram's after it
    assert output.forced == [forced] and output.drafts == [age]
    assert output.num_forced_tokens == len(forced) and output.num_draft_tokens == len(age)
    (inp,) = output.step_inputs
    assert inp.token_ids == written[-1:] + forced + age and inp.num_forced == len(forced)
    assert seq.constraint.valid_prefix(forced + age + brace) == len(forced + age)
    # the device keeps the first proposal and samples another digit after it: the sequence gains
    # the run, that proposal and the sample; its K/V is right up to the kept proposal
    one = encode(tokenizer, "1")
    scheduler.postprocess(output, [[age[0], *one]])
    assert seq.output_token_ids == written + forced + age[:1] + one
    assert seq.num_computed_tokens == seq.num_tokens - 1 and seq.num_pending_tokens == 0
    assert not seq.constraint.matcher.get_error()


def test_each_position_is_masked_after_the_proposals_before_it(grammar):
    tokenizer, backend, _, compiled = grammar
    constraint = SequenceConstraint(VOCAB, compiled, backend.valid_ids)
    assert constraint.ready
    proposals = encode(tokenizer, '{"patient":"M')
    assert constraint.forced_tokens(100) == proposals[:-1] and constraint.valid_prefix(proposals) == len(proposals)
    mask = np.full((1 + 2 * len(proposals), VOCAB // 32), -1, np.int32)
    fill_bitmask(None, [(constraint, 1, [], proposals)], mask)
    assert (mask[0] == -1).all() and (mask[2 + len(proposals) :] == -1).all()  # other rows untouched
    matcher = compiled.result().deep_copy()
    expected = llguidance.numpy.allocate_token_bitmask(1, VOCAB)
    for j in range(len(proposals) + 1):
        llguidance.numpy.fill_next_token_bitmask(matcher, expected, 0)
        assert (mask[1 + j] == expected[0] & backend.valid_ids).all(), j
        if j < len(proposals):
            matcher.consume_token(proposals[j])
    # the matcher is back where it was: the next step's first row is this one's
    again = np.full((1, VOCAB // 32), -1, np.int32)
    fill_bitmask(None, [(constraint, 0, [], [])], again)
    assert (again[0] == mask[1]).all()


def test_bad_words_ban_their_last_token_at_the_positions_after_their_first(grammar):
    tokenizer = grammar[0]
    quote, age = encode(tokenizer, '"age')
    constraint = SequenceConstraint(VOCAB, bad_words=[[quote, age]])
    assert constraint.valid_prefix([age, quote, quote, age]) == 3
    mask = np.full((4, VOCAB // 32), -1, np.int32)
    fill_bitmask(None, [(constraint, 0, [], [age, quote, quote])], mask)
    banned = [not mask.view(np.uint32)[j, age // 32] >> (age % 32) & 1 for j in range(4)]
    assert banned == [False, False, True, True]


def test_forced_run_stops_where_the_constraint_allows_another_token(grammar):
    tokenizer, backend, _, compiled = grammar
    forced = encode(tokenizer, '{"patient":"')
    constraint = SequenceConstraint(VOCAB, compiled, backend.valid_ids)
    assert constraint.ready and constraint.forced_run(100) == forced == constraint.forced_tokens(100)
    assert constraint.forced_run(2) == forced[:2]
    # allowed_token_ids without the third: plain decoding's row there is empty, not that token alone
    allowed = [t for t in range(VOCAB) if t != forced[2]]
    cut = SequenceConstraint(VOCAB, compiled, backend.valid_ids, allowed_token_ids=allowed)
    assert cut.ready and cut.forced_run(100) == forced[:2]
    mask = np.full((2, VOCAB // 32), -1, np.int32)  # a row after forced tokens is the plain row there
    fill_bitmask(None, [(constraint, 0, forced, [])], mask)
    write_matcher = compiled.result().deep_copy()
    assert write_matcher.consume_tokens(forced)
    llguidance.numpy.fill_next_token_bitmask(write_matcher, mask, 1)
    assert (mask[0] == mask[1] & backend.valid_ids).all() and constraint.forced_run(100) == forced  # rolled back


def test_decodes_compute_forced_tokens_unsampled_also_after_a_pending_token(grammar):
    """Async scheduling: the step scheduled while the first token is pending (its mask allows the
    schema's `{` alone) computes the rest of the forced run after it and samples once."""
    tokenizer, backend, so, compiled = grammar
    forced = encode(tokenizer, '{"patient":"')
    config = SchedulerConfig(max_model_len=256, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64)
    scheduler = Scheduler(config)
    seqs = []
    for logprobs in (None, 1):  # a request that wants logprobs samples every token
        params = SamplingParams(max_tokens=100, logprobs=logprobs, structured_outputs=so)
        seqs.append(Sequence(f"r{logprobs}", encode(tokenizer, "Moses"), params))
        seqs[-1].constraint = SequenceConstraint(VOCAB, compiled, backend.valid_ids)
        scheduler.add(seqs[-1])
    prefill = scheduler.schedule()
    assert prefill.num_decode_seqs == 0 and all(s.constraint.ready for s in seqs)
    step = scheduler.schedule()  # while the prefill's tokens are pending
    assert step.forced == [forced[1:], []] and step.num_forced_tokens == len(forced) - 1
    first = step.step_inputs[0]
    assert first.from_last and first.num_forced == len(forced) - 1 and first.token_ids[1:] == forced[1:]
    assert step.num_batched_tokens == len(forced) + 1 and step.num_prefill_tokens == 0
    scheduler.postprocess(prefill, [forced[0], forced[0]])
    m = encode(tokenizer, "M")
    scheduler.postprocess(step, [m[0], forced[1]])
    assert seqs[0].output_token_ids == forced + m and seqs[1].output_token_ids == forced[:2]
    assert seqs[0].num_pending_tokens == 0 and seqs[0].num_computed_tokens == seqs[0].num_tokens - 1
