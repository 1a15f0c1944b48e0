"""BlockManager: null block, ref counts, prefix caching (hits, salt, LRU, partial blocks), fork."""

import itertools

import pytest

from jaxpaged.core.block_manager import NULL_BLOCK, BlockManager
from jaxpaged.core.host_tier import HostTier
from jaxpaged.core.sequence import Sequence

BS = 4
_ids = itertools.count()


def make_seq(tokens, salt=None, request_id=None):
    return Sequence(request_id or f"r{next(_ids)}", list(tokens), cache_salt=salt)


def admit(bm, seq, num_new=None):
    """Allocates `seq` and extends it to hold all its tokens (or `num_new` more)."""
    assert bm.can_allocate(seq, num_new)
    bm.allocate(seq)
    n = seq.num_uncomputed if num_new is None else num_new
    bm.may_append(seq, n)
    return n


def compute(seq, n):
    """What the scheduler's postprocess does after the step ran."""
    seq.num_computed_tokens += n


def check_accounting(bm, seqs):
    owners = {}
    for s in seqs:
        assert NULL_BLOCK not in s.block_table
        assert len(set(s.block_table)) == len(s.block_table)
        for b in s.block_table:
            owners[b] = owners.get(b, 0) + 1
    assert bm.ref_counts[NULL_BLOCK] == 0
    for b in range(1, bm.num_blocks):
        assert bm.ref_counts[b] == owners.get(b, 0)
    free, cached = set(bm.free_block_ids), set(bm.evictable)
    assert not free & cached and NULL_BLOCK not in free | cached
    assert free | cached == {b for b in range(1, bm.num_blocks) if bm.ref_counts[b] == 0}
    assert bm.num_free_blocks + len(owners) == bm.num_total_blocks


def test_null_block_never_handed_out():
    bm = BlockManager(num_blocks=9, block_size=BS)
    seq = make_seq(range(100, 132))  # exactly 8 blocks
    compute(seq, admit(bm, seq))
    assert sorted(seq.block_table) == list(range(1, 9))
    assert bm.num_free_blocks == 0 and bm.usage == 1.0 and bm.num_total_blocks == 8
    assert not bm.can_append(seq, 1)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.may_append(seq, 1)
    bm.deallocate(seq)
    check_accounting(bm, [])
    assert bm.usage == 0.0


def test_prefix_hit_on_shared_prefix():
    bm = BlockManager(num_blocks=32, block_size=BS)
    a = make_seq(list(range(10)) + [50, 51])  # 12 tokens, 3 full blocks
    compute(a, admit(bm, a))
    b = make_seq(list(range(10)) + [60, 61, 62])  # shares 10 tokens = 2 full blocks
    admit(bm, b)
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    assert bm.prefix_cache_queries == 12 + 13 and bm.prefix_cache_hits == 8
    check_accounting(bm, [a, b])


def test_salt_isolates():
    bm = BlockManager(num_blocks=32, block_size=BS)
    prompt = list(range(13))
    a = make_seq(prompt, salt="alice")
    compute(a, admit(bm, a))
    for salt, hit in (("bob", 0), (None, 0), ("alice", 12)):
        s = make_seq(prompt, salt=salt)
        assert bm.get_computed_blocks(s).num_tokens == hit


def test_whole_prompt_cached_still_computes_last_token():
    bm = BlockManager(num_blocks=32, block_size=BS)
    a = make_seq(range(16))  # 4 full blocks, all registered
    compute(a, admit(bm, a))
    assert len(bm.cached_block_hash_to_block) == 4
    b = make_seq(range(16))
    admit(bm, b)
    assert b.num_computed_tokens == 12 and b.num_uncomputed == 4  # last block recomputed
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    # Equal content is already cached under a's block: b's copy stays unhashed.
    assert bm.block_hash[b.block_table[3]] is None
    c = make_seq(range(17))
    admit(bm, c)
    assert c.num_computed_tokens == 16 and c.num_uncomputed == 1


def test_partial_block_never_shared_until_full():
    bm = BlockManager(num_blocks=32, block_size=BS)
    a = make_seq(range(10))  # blocks: full, full, partial (2 of 4)
    compute(a, admit(bm, a))
    assert bm.block_hash[a.block_table[2]] is None
    b = make_seq(list(range(10)) + [99])
    assert bm.get_computed_blocks(b) == (a.block_table[:2], [None, None], 8)
    # a decodes two more tokens: its third block fills and becomes shareable.
    for t in (10, 11):
        a.output_token_ids.append(t)
        bm.may_append(a, 1)
        compute(a, 1)
    assert bm.block_hash[a.block_table[2]] is not None
    c = make_seq(list(range(12)) + [7])
    assert bm.get_computed_blocks(c) == (a.block_table[:3], [None] * 3, 12)


def test_freed_blocks_stay_cached_and_are_evicted_lru():
    bm = BlockManager(num_blocks=9, block_size=BS)  # 8 usable blocks
    seqs = [make_seq([k] * 8 + [0]) for k in (1, 2, 3)]  # 2 full blocks + 1 partial each
    for s in seqs[:2]:
        compute(s, admit(bm, s))
    a_blocks, b_blocks = seqs[0].block_table[:2], seqs[1].block_table[:2]
    bm.deallocate(seqs[0])
    bm.deallocate(seqs[1])
    assert bm.num_free_blocks == 8 and len(bm.evictable) == 4
    # Tail blocks are released first, so a's second block is the least recently used.
    assert list(bm.evictable) == [a_blocks[1], a_blocks[0], b_blocks[1], b_blocks[0]]
    # A hit revives a cached block; it leaves the evictable set.
    again = make_seq([2] * 8 + [5])
    admit(bm, again)
    assert again.block_table[:2] == b_blocks and not set(b_blocks) & set(bm.evictable)
    # 3 blocks in use -> 3 free + a's 2 cached; 4 new blocks evict a's tail block only.
    big = make_seq(range(100, 114))
    admit(bm, big)
    assert a_blocks[1] in big.block_table and a_blocks[0] not in big.block_table
    assert bm.get_computed_blocks(make_seq([1] * 8 + [0])).num_tokens == 4  # a's first block survives
    check_accounting(bm, [again, big])


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=32, block_size=BS, enable_prefix_caching=False)
    a = make_seq(range(16))
    compute(a, admit(bm, a))
    b = make_seq(range(16))
    admit(bm, b)
    assert b.num_cached_tokens == 0 and not set(a.block_table) & set(b.block_table)
    bm.deallocate(a)
    assert not bm.evictable and bm.prefix_cache_queries == 0
    check_accounting(bm, [b])


@pytest.mark.parametrize("caching", [True, False])
def test_a_sibling_shares_its_parents_full_prompt_blocks(caching):
    bm = BlockManager(num_blocks=32, block_size=BS, enable_prefix_caching=caching)
    parent = make_seq(range(10), request_id="req")
    compute(parent, admit(bm, parent))
    parent.output_token_ids.append(77)  # parent already decoding: its outputs are never shared
    child = make_seq(range(10), request_id="req")
    assert bm.can_allocate(child, 2, parent=parent)
    bm.allocate(child, parent)  # n > 1: the child shares the parent's computed full prompt blocks
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 8
    assert child.num_cached_tokens == 8
    bm.may_append(child, 2)  # the child recomputes the partial tail into its own block
    assert child.block_table[2] != parent.block_table[2]
    check_accounting(bm, [parent, child])
    bm.deallocate(parent)
    check_accounting(bm, [child])
    bm.deallocate(child)
    check_accounting(bm, [])


def test_a_sibling_of_an_unfinished_parent_shares_only_computed_blocks():
    bm = BlockManager(num_blocks=32, block_size=BS)
    parent = make_seq(range(20), request_id="req")
    admit(bm, parent, 6)
    compute(parent, 6)  # one chunk of 6: one full computed block
    child = make_seq(range(20), request_id="req")
    bm.allocate(child, parent)  # n > 1: the child shares the parent's computed full prompt blocks
    assert child.block_table == parent.block_table[:1] and child.num_computed_tokens == 4


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=16, block_size=BS)
    a = make_seq(range(12))
    compute(a, admit(bm, a))
    bm.deallocate(a)
    assert bm.evictable
    bm.reset_prefix_cache()
    assert not bm.evictable and not bm.cached_block_hash_to_block
    assert bm.get_computed_blocks(make_seq(range(12))).num_tokens == 0
    check_accounting(bm, [])


def test_after_a_reset_running_sequences_register_no_more_blocks():
    """After `reset_prefix_cache` (new weights: `update_weights`) a running sequence's KV mixes
    the old weights' with the new ones': its blocks filled later are never offered to others,
    even behind the same prefix computed again after the reset."""
    bm = BlockManager(num_blocks=32, block_size=BS)
    a = make_seq(range(10))  # blocks: full, full, partial
    compute(a, admit(bm, a))
    bm.reset_prefix_cache()
    b = make_seq(range(8))  # admitted after the reset: its two blocks are cached as usual
    compute(b, admit(bm, b))
    for t in (10, 11):  # a's third block fills after the reset
        a.output_token_ids.append(t)
        bm.may_append(a, 1)
        compute(a, 1)
    assert bm.get_computed_blocks(make_seq(list(range(12)) + [7])).num_tokens == 8  # b's blocks, not a's third


def test_after_a_reset_a_sequence_swapped_out_registers_nothing_when_back():
    """A sequence swapped out before `reset_prefix_cache` comes back with the old weights' K/V:
    neither its blocks swapped in nor those it fills later are offered to others."""
    bm = BlockManager(num_blocks=32, block_size=BS, host_tier=HostTier(8))
    a = make_seq(range(10))
    compute(a, admit(bm, a))
    assert bm.swap_out(a)
    bm.reset_prefix_cache()
    bm.allocate(a)  # swapped back in: 10 tokens computed
    for t in (10, 11):  # its third block fills
        a.output_token_ids.append(t)
        bm.may_append(a, 1)
        compute(a, 1)
    assert a.block_table and bm.get_computed_blocks(make_seq(list(range(12)) + [7])).num_tokens == 0
    check_accounting(bm, [a])
