"""Host tier of the KV cache (host side): evicted blocks offloaded and found again, swap-out and
swap-in of preempted sequences, pinned slots, salts, and the copies checked on a fake device."""

import itertools

import pytest

from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.host_tier import HostTier
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from jaxpaged.core.sequence import Sequence, SequenceStatus
from jaxpaged.sampling_params import SamplingParams

BS = 4
_ids = itertools.count()


class FakeMemory:
    """Device pool and host tier contents as tokens: a block's slot holds the token (and salt)
    whose K/V it would hold, so a copy that goes wrong shows up as a wrong token."""

    def __init__(self, bm: BlockManager):
        self.bm, self.pool, self.host = bm, {}, {}

    def write(self, seq: Sequence, start: int, end: int) -> None:
        for p in range(start, end):
            self.pool[(seq.block_table[p // BS], p % BS)] = (seq.cache_salt, tuple(seq.token_ids_slice(0, p + 1)))

    def check(self, seq: Sequence, upto: int) -> None:
        for p in range(upto):
            want = (seq.cache_salt, tuple(seq.token_ids_slice(0, p + 1)))
            assert self.pool.get((seq.block_table[p // BS], p % BS)) == want, f"position {p} of {seq}"

    def move(self, transfers=None) -> tuple[int, int]:
        """Runs `transfers` (a `SchedulerOutput`'s), else the block manager's planned copies."""
        t = self.bm.take_transfers() if transfers is None else transfers
        for block, slot in t.offloads:
            self.host[slot] = [self.pool.get((block, o)) for o in range(BS)]
        for slot, block in t.loads:
            for o, value in enumerate(self.host[slot]):
                self.pool[(block, o)] = value
        return len(t.offloads), len(t.loads)


def make_seq(tokens, salt=None):
    return Sequence(f"r{next(_ids)}", list(tokens), cache_salt=salt)


def run(bm, mem, seq):
    """Admits `seq`, copies, computes the rest of it and checks every position it attends to."""
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    n = seq.num_uncomputed
    bm.may_append(seq, n)
    moved = mem.move()
    mem.write(seq, seq.num_computed_tokens, seq.num_tokens)
    seq.num_computed_tokens += n
    mem.check(seq, seq.num_tokens)
    return moved


def test_evicted_blocks_go_to_host_and_come_back():
    bm = BlockManager(num_blocks=5, block_size=BS, host_tier=HostTier(8))  # 4 device blocks
    mem = FakeMemory(bm)
    a = make_seq(range(13))  # 3 full blocks + 1 token
    run(bm, mem, a)
    bm.deallocate(a)  # its 3 full blocks stay cached on the device
    b = make_seq(range(100, 116))  # 4 new blocks: evicts all of a's cached blocks
    assert run(bm, mem, b) == (3, 0)
    assert len(bm.host_tier.cached) == 3 and not bm.cached_block_hash_to_block.keys() & bm.host_tier.cached.keys()
    bm.deallocate(b)  # b's 4 full blocks are cached on the device now
    again = make_seq(list(range(12)) + [7, 8])
    prefix = bm.get_computed_blocks(again)
    assert prefix.blocks == [None] * 3 and prefix.num_tokens == 12 and None not in prefix.host_slots
    offloads, loads = run(bm, mem, again)  # loads a's 3 blocks into fresh blocks (evicting b's)
    assert loads == 3 and offloads == 4
    assert again.num_cached_tokens == 12
    tier = bm.host_tier
    assert tier.hits == 12 and tier.queries == 13 + 16 + 14 and bm.prefix_cache_hits == 0
    # The loaded blocks are registered on the device again: a third request hits them there.
    loaded = again.block_table[:3]
    bm.deallocate(again)
    third = make_seq(list(range(12)) + [9])
    assert bm.get_computed_blocks(third).blocks == loaded


def test_device_and_host_hits_interleave_in_one_prefix():
    bm = BlockManager(num_blocks=6, block_size=BS, host_tier=HostTier(8))  # 5 device blocks
    mem = FakeMemory(bm)
    a = make_seq(range(17))  # 4 full blocks + 1
    run(bm, mem, a)
    table = list(a.block_table)
    bm.deallocate(a)  # evictable, tail first: a3, a2, a1, a0 (its partial block is free)
    keep = make_seq(list(range(8)) + [50])  # revives a0, a1 on the device
    run(bm, mem, keep)
    filler = make_seq(range(200, 208))  # 2 blocks: evicts a3 and a2 to the host
    run(bm, mem, filler)
    prefix = bm.get_computed_blocks(make_seq(range(17)))
    assert prefix.blocks == table[:2] + [None, None] and prefix.num_tokens == 16
    assert [s is not None for s in prefix.host_slots] == [b is None for b in prefix.blocks]
    bm.deallocate(keep)
    bm.deallocate(filler)
    late = make_seq(range(17))
    run(bm, mem, late)  # checks every position of the mixed prefix
    assert late.num_cached_tokens == 16


def test_salted_blocks_never_meet_in_the_host_tier():
    bm = BlockManager(num_blocks=5, block_size=BS, host_tier=HostTier(16))
    mem = FakeMemory(bm)
    alice = make_seq(range(13), salt="alice")
    run(bm, mem, alice)
    bm.deallocate(alice)
    run(bm, mem, make_seq(range(100, 116)))  # pushes alice's blocks to the host tier
    assert len(bm.host_tier.cached) == 3
    for salt, hit in (("bob", 0), (None, 0), ("alice", 12)):
        assert bm.get_computed_blocks(make_seq(range(13), salt=salt)).num_tokens == hit


def test_a_slot_being_loaded_is_never_taken_by_an_offload():
    tier = HostTier(2)
    bm = BlockManager(num_blocks=4, block_size=BS, host_tier=tier)  # 3 device blocks
    mem = FakeMemory(bm)
    a = make_seq(range(9))
    run(bm, mem, a)
    bm.deallocate(a)
    b = make_seq(range(100, 109))
    run(bm, mem, b)  # a's 2 blocks evicted into both host slots
    bm.deallocate(b)  # b's 2 full blocks cached on the device
    again = make_seq(range(9))
    # Loading a's 2 blocks takes 2 device blocks (evicting b's 2, whose offloads need slots):
    # both slots are pinned for the loads, so b's blocks are dropped, not written over a's.
    offloads, loads = run(bm, mem, again)
    assert (offloads, loads) == (0, 2) and again.num_cached_tokens == 8
    assert len(tier.cached) == 2


def test_swap_out_and_in_copies_every_computed_block():
    tier = HostTier(8)
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False, host_tier=tier)
    mem = FakeMemory(bm)
    seq = make_seq(range(10))
    run(bm, mem, seq)
    seq.output_token_ids.append(42)  # decoding: 10 computed, 1 to compute
    table = list(seq.block_table)
    assert bm.swap_out(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0 and tier.swapped[seq.seq_id][1] == 10
    assert mem.move() == (3, 0)  # the partial third block too
    for block in table:  # another sequence overwrites the device blocks meanwhile
        for o in range(BS):
            mem.pool[(block, o)] = "garbage"
    prefix = bm.get_computed_blocks(seq)
    assert prefix.num_tokens == 10 and prefix.blocks == [None] * 3
    offloads, loads = run(bm, mem, seq)  # computes only the new token; checks all 11
    assert (offloads, loads) == (0, 3) and seq.num_cached_tokens == 10
    assert not tier.swapped and tier.num_free == 8
    assert tier.swapped_out_blocks == tier.swapped_in_blocks == 3


def test_swap_needs_room_and_aborted_swaps_free_their_slots():
    tier = HostTier(2)
    bm = BlockManager(num_blocks=8, block_size=BS, host_tier=tier)
    mem = FakeMemory(bm)
    big = make_seq(range(12))
    run(bm, mem, big)
    assert not bm.swap_out(big) and big.block_table  # 3 blocks, 2 slots: nothing done
    small = make_seq(range(50, 57))
    run(bm, mem, small)
    assert bm.swap_out(small) and tier.num_free == 0
    mem.move()
    bm.deallocate(small)  # aborted while waiting
    assert not tier.swapped and tier.num_free == 2


def scheduler(num_host_blocks, mode, **kw):
    cfg = SchedulerConfig(
        max_num_seqs=4,
        max_num_batched_tokens=32,
        max_model_len=64,
        block_size=BS,
        num_blocks=7,
        num_host_blocks=num_host_blocks,
        preemption_mode=mode,
        num_scheduler_steps=1,
        **kw,
    )
    return Scheduler(cfg, eos_token_id=1)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_scheduler_preempts_by_swap_and_resumes_without_recompute(mode):
    sched = scheduler(16, mode, enable_prefix_caching=False)  # 6 device blocks
    mem = FakeMemory(sched.block_manager)
    a = Sequence("a", [2] * 8, SamplingParams(max_tokens=12))
    b = Sequence("b", [3] * 8, SamplingParams(max_tokens=12))
    sched.add(a)
    sched.add(b)
    resumed = None
    for _ in range(40):
        out = sched.schedule()
        mem.move(out.transfers)
        for (seq, n), inp in zip(out.scheduled, out.step_inputs):
            mem.write(seq, inp.num_computed, inp.num_computed + n)
            mem.check(seq, inp.num_computed + n)
            if seq is b and b.num_preemptions and resumed is None:
                resumed = (inp.num_computed, n)
        sched.postprocess(out, [7] * out.num_seqs)
        if not sched.has_unfinished():
            break
    assert b.num_preemptions == 1 and b.status is SequenceStatus.FINISHED_LENGTH
    if mode == "swap":  # b resumed with everything computed but its last sampled token
        assert resumed[0] > 8 and resumed[1] == 1
        assert sched.block_manager.host_tier.swapped_in_blocks > 0
    else:  # prompt and outputs so far computed again
        assert resumed[0] == 0 and resumed[1] > 8
