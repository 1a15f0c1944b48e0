"""Scheduler: batching order, chunked prefill, preemption, stops, aborts, and random-workload
invariants (with host tiers, write-through and speculative proposals: the K/V every step reads
is what its tokens give, so no rejected proposal is ever read, cached or shared)."""

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpaged.config.speculative import SpeculativeConfig
from jaxpaged.core.block_manager import NULL_BLOCK
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from jaxpaged.core.sequence import Sequence, SequenceStatus
from jaxpaged.core.speculation import DraftModelProposer, NgramProposer
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.worker.input_batch import InputBatch
from jaxpaged.worker.step_packer import StepPacker

EOS = 1
_ids = itertools.count()


def make_sched(eos=EOS, **kw):
    cfg = dict(
        max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, block_size=4, num_blocks=64, num_scheduler_steps=1
    )
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg), eos_token_id=eos)


def make_seq(prompt, request_id=None, index=0, **params):
    params.setdefault("max_tokens", 8)
    return Sequence(request_id or f"r{next(_ids)}", list(prompt), SamplingParams(**params), index=index)


def step(sched, token=7):
    """One engine step with a fake sampler that always returns `token`."""
    out = sched.schedule()
    appended = sched.postprocess(out, [token] * out.num_seqs)
    return out, [seq for _, seq, _ in appended if seq.is_finished]


def batch(out):
    return [(seq.request_id, n) for seq, n in out.scheduled]


def test_chunked_prefill_respects_budget_fcfs():
    sched = make_sched(max_num_batched_tokens=8)
    a, b = make_seq(range(10, 20), "a"), make_seq([5, 6, 7], "b")
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)
    assert batch(out) == [("a", 8)] and out.samples == [False] and a.num_output_tokens == 0
    assert out.step_inputs[0].token_ids == list(range(10, 18)) and out.step_inputs[0].num_computed == 0
    out, _ = step(sched)
    assert batch(out) == [("a", 2), ("b", 3)] and out.samples == [True, True]
    assert out.step_inputs[0].token_ids == [18, 19] and out.step_inputs[0].num_computed == 8
    assert out.num_batched_tokens == 5 and out.num_decode_seqs == 0
    out, _ = step(sched)
    assert batch(out) == [("a", 1), ("b", 1)] and out.num_decode_seqs == 2
    assert out.step_inputs[0].token_ids == [7] and out.step_inputs[0].num_computed == 10
    assert len(out.step_inputs[0].block_table) * 4 >= 11


def test_decodes_go_first():
    sched = make_sched()
    sched.add(make_seq([3] * 6, "a"))
    step(sched)
    sched.add(make_seq([4] * 5, "b"))
    out, _ = step(sched)
    assert batch(out) == [("a", 1), ("b", 5)] and out.num_decode_seqs == 1 and out.num_prefill_tokens == 5


def test_max_num_seqs_and_fcfs_admission():
    sched = make_sched(max_num_seqs=2)
    for name in "abc":
        sched.add(make_seq([2, 3, 4], name, max_tokens=2))
    out, _ = step(sched)
    assert batch(out) == [("a", 3), ("b", 3)] and [s.request_id for s in sched.waiting] == ["c"]
    out, finished = step(sched)
    assert {s.request_id for s in finished} == {"a", "b"}
    out, _ = step(sched)
    assert batch(out) == [("c", 3)]


def test_waiting_head_blocks_the_queue():
    # FCFS: a big head that does not fit is not overtaken by a small one behind it.
    sched = make_sched(num_blocks=9, max_model_len=32, max_num_seqs=4)
    sched.add(make_seq(range(20, 40), "big0", max_tokens=4))  # 5 blocks
    step(sched)
    sched.add(make_seq(range(40, 60), "big1", max_tokens=4))  # needs 5, 3 free
    sched.add(make_seq([9], "small"))
    out, _ = step(sched)
    assert batch(out) == [("big0", 1)] and [s.request_id for s in sched.waiting] == ["big1", "small"]


@pytest.mark.parametrize("caching", [False, True])
def test_preemption_recomputes_the_latest_admitted_and_requeues_it_first(caching):
    sched = make_sched(num_blocks=7, max_num_batched_tokens=32, enable_prefix_caching=caching)  # 6 usable
    a, b = make_seq([2] * 8, "a", max_tokens=12), make_seq([3] * 8, "b", max_tokens=12)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefilled: 2 blocks each
    sched.add(make_seq([4] * 8, "c"))  # cannot be admitted: 2 free blocks, both needed next step
    for _ in range(4):  # positions 8..11 share each sequence's third block
        out, _ = step(sched)
        assert not out.preempted and batch(out) == [("a", 1), ("b", 1)]
    out, _ = step(sched)  # a needs a fourth block: none free -> preempt b
    assert out.preempted == [b] and batch(out) == [("a", 1)]
    assert sched.num_preemptions == b.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    outputs_before = list(b.output_token_ids)
    while a.status is SequenceStatus.RUNNING:
        out, _ = step(sched, token=8)
    out, _ = step(sched, token=9)
    assert batch(out)[0][0] == "b"
    # On resume b recomputes prompt + outputs so far (minus prefix-cache hits), then samples.
    _, n = out.scheduled[0]
    assert b.num_cached_tokens + n == 8 + len(outputs_before) and out.samples[0]
    # b's blocks were freed tail first; a's growth evicted all but b's first one.
    assert b.num_cached_tokens == (4 if caching else 0)
    assert b.output_token_ids == outputs_before + [9]


def test_stop_conditions():
    sched = make_sched(max_num_seqs=5)
    seqs = {
        "eos": make_seq([5, 6], max_tokens=8),
        "ignore": make_seq([5, 6], max_tokens=3, ignore_eos=True),
        "stop_id": make_seq([5, 6], max_tokens=8, stop_token_ids=[7]),
        "min": make_seq([5, 6], max_tokens=8, min_tokens=2),
        "none": make_seq([5, 6], max_tokens=None),
    }
    for s in seqs.values():
        sched.add(s)
    out = sched.schedule()
    tokens = {"eos": EOS, "ignore": EOS, "stop_id": 7, "min": EOS, "none": 3}
    appended = sched.postprocess(out, {s.seq_id: tokens[k] for k, s in seqs.items()})
    assert {s for _, s, _ in appended} == set(seqs.values())
    finished = [s for _, s, _ in appended if s.is_finished]
    assert set(finished) == {seqs["eos"], seqs["stop_id"]}
    assert seqs["eos"].status is SequenceStatus.FINISHED_STOPPED and seqs["eos"].stop_reason is None
    assert seqs["stop_id"].stop_reason == 7 and seqs["stop_id"].status.finish_reason == "stop"
    assert seqs["eos"].block_table == [] and seqs["eos"].finish_time is not None
    while sched.running:
        step(sched, token=EOS)
    assert seqs["min"].num_output_tokens == 2 and seqs["min"].status is SequenceStatus.FINISHED_STOPPED
    assert seqs["ignore"].num_output_tokens == 3 and seqs["ignore"].status is SequenceStatus.FINISHED_LENGTH
    assert seqs["none"].num_output_tokens == 2  # its second token was EOS


def test_max_tokens_none_stops_at_max_model_len():
    sched = make_sched(max_model_len=12, eos=None)
    s = make_seq(range(5), max_tokens=None)
    sched.add(s)
    while sched.has_unfinished():
        step(sched)
    assert s.num_tokens == 12 and s.status is SequenceStatus.FINISHED_LENGTH


def test_rejections_name_the_numbers_and_the_knob():
    sched = make_sched(max_model_len=32, num_blocks=5)  # 4 blocks of 4 = 16 tokens
    with pytest.raises(ValueError, match=r"prompt \(30 tokens\) \+ max_tokens \(8\) = 38 exceeds max_model_len \(32\)"):
        sched.add(make_seq(range(30)))
    with pytest.raises(
        ValueError, match=r"needs 6 KV blocks.*has 4 \(num_blocks=5.*gpu_memory_utilization or kv_cache_memory_bytes"
    ):
        sched.add(make_seq(range(16)))
    with pytest.raises(ValueError, match="empty"):
        sched.add(make_seq([]))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(make_seq(range(32), max_tokens=None))
    sched.add(make_seq(range(9), max_tokens=8))  # 16 tokens of K/V: fits exactly
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=8, num_blocks=4)


def test_abort_and_finish_free_blocks_wherever_the_sequence_is():
    sched = make_sched(max_num_seqs=1)
    run, wait = make_seq([2] * 9, "run"), make_seq([3] * 9, "wait")
    sched.add(run)
    sched.add(wait)
    out = sched.schedule()
    assert sched.abort("wait") == [wait] and wait.status is SequenceStatus.FINISHED_ABORTED
    assert sched.abort("run") == [run] and sched.block_manager.num_free_blocks == 63
    assert sched.postprocess(out, [5]) == [] and run.output_token_ids == []  # aborted meanwhile
    assert sched.abort("run") == [] and not sched.has_unfinished()
    s = make_seq([4] * 3)
    sched.add(s)
    step(sched)
    sched.finish_sequence(s, SequenceStatus.FINISHED_STOPPED, stop_reason="###")
    assert s.stop_reason == "###" and not sched.running and sched.block_manager.usage == 0


@pytest.mark.parametrize("caching", [False, True])
def test_parallel_samples_share_prompt_blocks(caching):
    sched = make_sched(max_num_batched_tokens=8, enable_prefix_caching=caching)
    parent, child = (make_seq(range(10, 20), "req", index=i, temperature=1.0) for i in range(2))
    sched.add(parent)
    sched.add(child)
    step(sched)  # parent's first chunk only
    out, _ = step(sched)  # parent finishes its prompt; the child joins, forking/hitting 2 blocks
    assert batch(out) == [("req", 2), ("req", 2)]
    assert child.num_cached_tokens == 8 and child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    assert [sched.block_manager.ref_counts[b] for b in parent.block_table] == [2, 2, 1]


def test_gauges_and_prefix_cache_counters():
    sched = make_sched()
    sched.add(make_seq(range(9)))
    sched.add(make_seq(range(9)))
    step(sched)
    bm = sched.block_manager
    assert sched.num_running == 2 and sched.num_waiting == 0 and sched.num_preemptions == 0
    assert bm.prefix_cache_queries == 18 and bm.prefix_cache_hits == 8  # the second finds the first's full block
    assert 0 < bm.usage < 1


# ---- property-based: random add / step / abort workloads ----------------------------------

BASES = [[random.Random(f).randrange(2, 50) for _ in range(40)] for f in range(3)]


def check_invariants(sched, live):
    bm = sched.block_manager
    owners: dict[int, list[tuple[Sequence, int]]] = {}
    for seq in sched.waiting:
        assert seq.block_table == [] and seq.status is SequenceStatus.WAITING
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens
        # between steps a sequence holds the blocks of its computed tokens, no more: none is
        # left holding only rejected proposals
        assert len(seq.block_table) == -(-seq.num_computed_tokens // bm.block_size)
        for i, b in enumerate(seq.block_table):
            assert b != NULL_BLOCK
            owners.setdefault(b, []).append((seq, i))
    for seq in live:
        if seq.is_finished:
            assert seq.block_table == []
    assert bm.ref_counts[NULL_BLOCK] == 0
    for b in range(1, bm.num_blocks):
        held = owners.get(b, [])
        assert bm.ref_counts[b] == len(held)
        if len(held) > 1:  # legitimately shared: the same full block of equal prefixes
            (s0, i0), bs = held[0], bm.block_size
            assert len({s for s, _ in held}) == len(held)  # never twice in one table
            for s, i in held:
                assert i == i0 and s.num_tokens >= (i + 1) * bs
                assert s.token_ids_slice(0, (i + 1) * bs) == s0.token_ids_slice(0, (i + 1) * bs)
    free, cached = set(bm.free_block_ids), set(bm.evictable)
    assert not free & cached and NULL_BLOCK not in free | cached
    assert free | cached == {b for b in range(1, bm.num_blocks) if bm.ref_counts[b] == 0}
    assert bm.num_free_blocks + len(owners) == bm.num_total_blocks
    tier = bm.host_tier
    if tier is not None:  # every host slot is free, cached or one swapped sequence's, never two
        waiting = {s.seq_id for s in sched.waiting}
        assert set(tier.swapped) <= waiting
        held = list(tier._free) + list(tier.cached.values()) + [x for slots, _ in tier.swapped.values() for x in slots]
        assert sorted(held) == list(range(tier.num_slots))


def move_blocks(transfers, pool, host, block_size):
    """The runner's device<->host copies on the fake pool: offloads, then loads (before a step),
    or the write-through copies of what the step computed (`stores`, after it)."""
    for block, slot in transfers.offloads:
        host[slot] = [pool.get(block * block_size + o) for o in range(block_size)]
    for slot, block in transfers.loads:
        for o, key in enumerate(host[slot]):
            pool[block * block_size + o] = key


def device_step(sched, out, pool, rng, host=None, device_tokens=None, known=None):
    """The fake device for one scheduled step: the host copies, then write-then-attend on a
    model pool, then a sampler. `device_tokens` (seq_id -> outputs) holds every sequence's
    tokens as the device knows them, pending ones included (async scheduling feeds them before
    the host has them). Returns each entry's sampled tokens (accepted proposals, then one)."""
    cfg = sched.config
    host = {} if host is None else host
    device_tokens = {} if device_tokens is None else device_tokens
    move_blocks(out.transfers, pool, host, cfg.block_size)
    assert out.num_batched_tokens == sum(n for _, n in out.scheduled) <= cfg.max_num_batched_tokens
    assert len(out.scheduled) <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    assert len({s.seq_id for s, _ in out.scheduled}) == len(out.scheduled)

    def slot(inp, p):
        return inp.block_table[p // cfg.block_size] * cfg.block_size + p % cfg.block_size

    # What the K/V at position p depends on: the salt and every token fed up to p (a sequence's
    # own tokens, as the device has them, then the proposals it checks this step).
    drafts = out.drafts or [[]] * out.num_seqs
    tokens = [
        seq.prompt_token_ids + device_tokens.get(seq.seq_id, []) + d for (seq, _), d in zip(out.scheduled, drafts)
    ]
    keys = [
        [(seq.cache_salt, tuple(toks[: p + 1])) for p in range(len(toks))]
        for (seq, _), toks in zip(out.scheduled, tokens)
    ]
    for (seq, n), inp, key, toks, d in zip(out.scheduled, out.step_inputs, keys, tokens, drafts):
        assert seq.status is SequenceStatus.RUNNING and seq not in out.preempted
        assert seq.num_computed_tokens == inp.num_computed + n  # counted as computed once scheduled
        assert 1 <= n - len(d) <= len(toks) - len(d) - inp.num_computed
        assert not d or n == 1 + len(d) and not inp.from_last  # only decoding sequences check proposals
        if inp.from_last:  # the token the previous step sampled, not yet on the host
            assert n == 1 and inp.num_computed == seq.num_tokens and seq.num_pending_tokens
        else:
            assert inp.token_ids == toks[inp.num_computed : inp.num_computed + n]
        for p in range(inp.num_computed, inp.num_computed + n):
            pool[slot(inp, p)] = key[p]
    for (seq, n), inp, key in zip(out.scheduled, out.step_inputs, keys):  # attention reads all
        for p in range(inp.num_computed + n):
            assert pool.get(slot(inp, p)) == key[p], f"stale K/V for {seq} at {p}"
    sampled = []  # a random number of each entry's proposals kept, then a token of the sampler's
    for (seq, _), inp, d in zip(out.scheduled, out.step_inputs, drafts):
        kept = rng.randint(0, len(d))
        sampled.append(d[:kept] + [EOS if rng.random() < 0.03 else rng.randrange(2, 8)])
        if inp.samples:
            device_tokens.setdefault(seq.seq_id, []).extend(sampled[-1])
    move_blocks(out.stores, pool, host, cfg.block_size)
    tier = sched.block_manager.host_tier
    if tier is not None:  # every cached host block holds the K/V its hash names
        bs, known = cfg.block_size, {} if known is None else known
        for seq, _ in out.scheduled:
            for i, block_hash in enumerate(seq.block_hashes):
                known[block_hash] = (seq.cache_salt, tuple(seq.token_ids_slice(0, (i + 1) * bs)))
        for block_hash, slot in tier.cached.items():
            salt, last = known[block_hash]
            assert host[slot] == [(salt, last[: len(last) - bs + 1 + o]) for o in range(bs)], (
                f"host slot {slot} is stale"
            )
    return sampled if out.num_draft_tokens else [t[-1] for t in sampled]


def run_step(sched, pool, rng, host=None, known=None, device_tokens=None, in_flight=None, slots=None):
    """schedule + fake device + postprocess; with `in_flight` (a list: async scheduling) the
    step is scheduled and run before the previous one's results are postprocessed; with `slots`
    (an `InputBatch`) the runner's slots are released and taken as the engine's runner does."""
    out = sched.schedule()
    if slots is not None:
        slots.release(out.released_seq_ids)
        slots.prepare(out.step_inputs)  # every scheduled sequence holds a slot, none twice
    if sched.has_unfinished() and not in_flight:
        assert not out.is_empty, "unfinished requests but nothing scheduled"
    sampled = device_step(sched, out, pool, rng, host, device_tokens, known)
    if in_flight is None:
        return sched.postprocess(out, sampled)
    appended = sched.postprocess(*in_flight.pop()) if in_flight else []
    in_flight.append((out, sampled))
    return appended


config_st = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "pool_tokens": st.integers(40, 100),  # most requests fit alone, a few together
        "max_num_seqs": st.sampled_from([1, 2, 3, 4, 6]),
        "extra_budget": st.integers(0, 40),
        "enable_prefix_caching": st.booleans(),
        # host tier blocks, preemption mode, write-through (as with a disk tier)
        "host": st.sampled_from(
            [
                (0, "recompute", False),
                (3, "recompute", False),
                (12, "recompute", False),
                (3, "swap", False),
                (40, "swap", False),
                (12, "swap", True),
                (4, "recompute", True),
            ]
        ),
        # speculative decoding: proposals per step (0: off)
        "speculative_tokens": st.sampled_from([0, 0, 1, 3]),
        # async scheduling: each step scheduled before the previous one's tokens are back
        # (as the engine does it, without proposals)
        "async_scheduling": st.booleans(),
    }
)
add_st = st.tuples(
    st.just("add"), st.integers(0, 2), st.integers(1, 30), st.integers(1, 16), st.integers(0, 3), st.integers(1, 3)
)
op_st = st.one_of(
    add_st,
    add_st,
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=config_st, ops=st.lists(op_st, min_size=10, max_size=40), seed=st.integers(0, 2**32 - 1))
def test_random_workloads_keep_invariants_and_finish(config, ops, seed):
    extra, pool_tokens = config.pop("extra_budget"), config.pop("pool_tokens")
    num_blocks = 1 + pool_tokens // config["block_size"]
    budget = config["max_num_seqs"] + extra
    num_host_blocks, mode, write_through = config.pop("host")
    k = config.pop("speculative_tokens")
    in_flight = [] if config.pop("async_scheduling") and not k else None
    device_tokens = {}
    slots = InputBatch(
        StepPacker(
            block_size=config["block_size"],
            max_model_len=48,
            max_num_seqs=config["max_num_seqs"],
            max_num_batched_tokens=64,
            vocab_size=64,
        ),
        config["max_num_seqs"],
    )
    proposer = NgramProposer(SpeculativeConfig("ngram", k, 3, 1)) if k else None
    cfg = SchedulerConfig(
        max_model_len=48,
        max_num_batched_tokens=budget,
        num_blocks=num_blocks,
        num_host_blocks=num_host_blocks,
        preemption_mode=mode,
        num_scheduler_steps=1,
        **config,
    )
    sched, rng, pool, host, known = Scheduler(cfg, eos_token_id=EOS, proposer=proposer), random.Random(seed), {}, {}, {}
    if write_through:
        sched.block_manager.host_tier.write_through = True
    live, request_ids = [], []
    for op in ops:
        if op[0] == "add":
            _, family, plen, max_tokens, variant, n = op
            prompt = BASES[family][:plen] + ([50 + variant] if variant else [])
            salt = "s" if variant == 3 else None
            params = SamplingParams(n=n, max_tokens=max_tokens, stop_token_ids=[2] if variant == 2 else None)
            rid = f"r{len(request_ids)}"
            seqs = [Sequence(rid, prompt, params, index=i, cache_salt=salt) for i in range(n)]
            try:
                for s in seqs:
                    sched.add(s)
            except ValueError:
                blocks = -(-(len(prompt) + max_tokens - 1) // cfg.block_size)
                assert len(prompt) + max_tokens > cfg.max_model_len or blocks > cfg.num_blocks - 1
                assert not any(s in sched.waiting for s in seqs)
                continue
            live += seqs
            request_ids.append(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                run_step(sched, pool, rng, host, known, device_tokens, in_flight, slots)
        else:  # most ids are unknown or finished: aborting them is a no-op
            aborted = sched.abort(f"r{op[1]}")
            assert all(s.status is SequenceStatus.FINISHED_ABORTED for s in aborted)
        check_invariants(sched, live)
    for _ in range(3000):
        if not (sched.has_unfinished() or in_flight):
            break
        run_step(sched, pool, rng, host, known, device_tokens, in_flight, slots)
        check_invariants(sched, live)
    assert not sched.has_unfinished() and all(s.is_finished for s in live)
    assert not any(s.num_pending_tokens for s in live)
    slots.release(sched.schedule().released_seq_ids)  # the last finished sequences' slots come back
    assert slots.num_free_slots == cfg.max_num_seqs
    for s in live:
        if s.status is not SequenceStatus.FINISHED_ABORTED:
            assert 1 <= s.num_output_tokens <= s.sampling_params.max_tokens
    bm = sched.block_manager
    assert not any(bm.ref_counts) and bm.num_free_blocks == bm.num_total_blocks and bm.usage == 0
    if bm.host_tier is not None:  # every host slot free or cached: none leaked to a swap
        tier = bm.host_tier
        assert not tier.swapped and tier.num_free + len(tier.cached) == tier.num_slots


def test_fused_decode_windows_reserve_their_blocks_and_stop_at_max_tokens():
    """A decode-only batch fuses `num_scheduler_steps` steps when nobody waits; a sequence whose
    max_tokens falls inside the window takes part for its own steps only (no block reserved and
    no token kept past it); min_tokens no longer stops fusing (the device bans by position)."""
    sched = make_sched(num_scheduler_steps=4)
    a = make_seq([1, 2, 3], max_tokens=8, min_tokens=6)
    b = make_seq([4, 5, 6, 7], max_tokens=3)
    sched.add(a)
    sched.add(b)
    out, _ = step(sched)  # prefill: not a decode batch
    assert out.num_steps == 1
    out = sched.schedule()  # both decode now: fused
    assert out.num_steps == 4 and [i.live_steps for i in out.step_inputs] == [4, 2]
    # a: 3 prompt + 1 output tokens and 3 more of its window: 2 blocks of 4; b: 4 + 1 + 1
    assert len(a.block_table) == 2 and len(b.block_table) == 2
    assert a.num_computed_tokens == 3 + 4 and b.num_computed_tokens == 4 + 2
    appended = sched.postprocess(out, [[10, 11, 12, 13], [20, 21]])
    assert a.output_token_ids == [7, 10, 11, 12, 13] and b.output_token_ids == [7, 20, 21]
    assert b.status is SequenceStatus.FINISHED_LENGTH and [(i, n) for i, _, n in appended] == [(0, 4), (1, 2)]
    sched.add(make_seq([9]))
    assert sched.schedule().num_steps == 1  # a prompt waits: it must not be held back


def test_a_streaming_sequence_decodes_one_step_at_a_time():
    """While any scheduled sequence streams (DELTA outputs), decode steps are not fused: its
    client gets every token as it is sampled; once it finishes, the others fuse again."""
    sched = make_sched(num_scheduler_steps=4)
    offline = make_seq([1, 2, 3], max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY)
    stream = make_seq([4, 5, 6], max_tokens=3, output_kind=RequestOutputKind.DELTA)
    sched.add(offline)
    sched.add(stream)
    step(sched)  # prefill
    kinds = [step(sched)[0].num_steps for _ in range(2)]  # the stream's 2nd and 3rd tokens, one a step
    assert kinds == [1, 1] and stream.is_finished
    assert sched.schedule().num_steps == 4  # the offline sequence alone: fused again


def test_async_schedule_reads_pending_tokens_on_the_device():
    """Scheduled before the previous step's tokens are back, a decoding sequence's token is the
    device's (`from_last`), a sequence whose pending token is its last gets nothing, and a
    finished sequence's runner slot is released at the next schedule."""
    sched = make_sched(max_num_seqs=2)
    a, b = make_seq([1, 2, 3, 4, 5], max_tokens=4, ignore_eos=True), make_seq([6, 7, 8], max_tokens=1)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # both prefill
    assert first.samples == [True, True] and a.num_pending_tokens == b.num_pending_tokens == 1
    second = sched.schedule()  # before the first step's tokens are back
    assert batch(second) == [(a.request_id, 1)] and second.step_inputs[0].from_last  # b's pending token ends it
    assert a.num_computed_tokens == 6 and a.num_tokens == 5 and a.num_pending_tokens == 2
    sched.postprocess(first, [9, 9])
    assert a.output_token_ids == [9] and b.status is SequenceStatus.FINISHED_LENGTH
    assert sched.schedule().released_seq_ids == [b.seq_id]  # its runner slot is free again
    sched.postprocess(second, [11])
    assert a.output_token_ids == [9, 11] and a.num_pending_tokens == 1


def test_a_sequence_preempted_with_a_token_in_flight_gets_it_before_it_returns():
    sched = make_sched(num_blocks=4, max_num_seqs=2, enable_prefix_caching=False)  # 3 blocks of 4 tokens
    a, b = make_seq([1, 2, 3, 4], max_tokens=8, ignore_eos=True), make_seq([5, 6, 7, 8], max_tokens=8, ignore_eos=True)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # 2 blocks; both sample
    second = sched.schedule()  # each needs a second block: one is left, so b (newest) is preempted
    assert batch(second) == [(a.request_id, 1)] and second.preempted == [b] and b.num_pending_tokens == 1
    assert b.seq_id in second.released_seq_ids and b.block_table == []
    assert sched.schedule().scheduled == [(a, 1)]  # b waits for its token (and a block)
    sched.postprocess(first, [20, 30])
    assert b.output_token_ids == [30] and b.num_pending_tokens == 0 and b.status is SequenceStatus.WAITING


def test_proposals_take_only_what_decodes_leave():
    """Every decode gets its own token before any sequence gets proposals, and proposals use
    free blocks only: with one free block, three decodes run and nobody is preempted for a
    proposal (which then waits for a step with room)."""
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, 3, 1))
    sched = Scheduler(
        SchedulerConfig(max_model_len=64, block_size=4, num_blocks=8, enable_prefix_caching=False), proposer=proposer
    )
    prompts = ([1, 2, 3, 1, 2, 3, 1], [9, 8, 7, 6, 5, 4, 3, 2], [5, 5, 6, 6, 7, 7, 8])
    seqs = [make_seq(p, max_tokens=8, ignore_eos=True) for p in prompts]
    for seq in seqs:
        sched.add(seq)
    sched.postprocess(sched.schedule(), [2, 11, 13])  # prefills; "a" now ends "... 3 1 2": its lookup matches
    assert sched.block_manager.num_free_blocks == 1
    out = sched.schedule()
    assert [n for _, n in out.scheduled] == [1, 1, 1] and not out.preempted
    assert out.drafts == [[], [], []]  # "a"'s proposals would need a second free block
    sched.postprocess(out, [[3], [12], [14]])
    sched.abort(seqs[2].request_id)  # room appears: "a" checks its proposals now
    out = sched.schedule()
    assert out.drafts[0] and out.scheduled[0][1] == 1 + len(out.drafts[0]) and not out.preempted


def test_draft_model_proposals_come_from_the_previous_steps_output():
    """A draft model's proposals follow the n-gram path one step later: a speculating step marks
    the entries the draft proposes for (`drafting`) and gives them room for its k positions from
    free blocks; the proposals of that step's output become the sequences' `spec_token_ids`, which
    the next speculating step checks; the room goes back after the step, and a plain step neither
    drafts nor checks (its output carries no proposals, so stale ones are dropped)."""
    k, bs = 3, 4
    sched = Scheduler(
        SchedulerConfig(max_model_len=64, block_size=bs, num_blocks=16, num_scheduler_steps=4),
        proposer=DraftModelProposer(SpeculativeConfig("draft_model", k, 0, 0, model="draft")),
    )
    seqs = [
        make_seq([5, 6, 7, 8, 9], max_tokens=20, ignore_eos=True),
        make_seq([3, 4], max_tokens=20, repetition_penalty=1.2),
    ]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule(propose=True)  # prefills that sample: the draft proposes after them
    a, b = seqs
    assert out.drafting == [True, False]  # b's penalties never speculate
    assert len(a.block_table) == -(-(5 + k) // bs) and len(b.block_table) == 1
    sched.postprocess(out, [11, 12], proposals={a.seq_id: [21, 22, 23]})
    assert a.spec_token_ids == [21, 22, 23] and b.spec_token_ids == []
    assert len(a.block_table) == -(-5 // bs)  # the draft's room went back

    out = sched.schedule(propose=True)
    assert out.drafts == [[21, 22, 23], []] and out.drafting == [True, False] and out.num_steps == 1
    assert len(a.block_table) * bs >= a.num_computed_tokens + k  # the step's 4 tokens, then k for the draft
    sched.postprocess(out, [[21, 40], [13]], proposals={a.seq_id: [41, 42, 43]})  # one accepted
    assert a.output_token_ids == [11, 21, 40] and a.spec_token_ids == [41, 42, 43] and a.num_computed_tokens == 7

    out = sched.schedule(propose=False)  # plain: no proposals checked, none made, decode steps fuse
    assert out.drafts == [[], []] and out.drafting == [False, False] and out.num_steps == 4
    sched.postprocess(out, [[50, 51, 52, 53], [14, 15, 16, 17]])
    assert a.spec_token_ids == []  # the proposals were for tokens before these
    out = sched.schedule(propose=True)
    assert out.drafts == [[], []] and out.drafting == [True, False]
    sched.abort([a.request_id, b.request_id])
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_total_blocks
