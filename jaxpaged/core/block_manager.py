"""Paged KV-cache block allocation with prefix caching (host only, no JAX here).

The pool has `num_blocks` blocks of `block_size` token slots; block 0 is the reserved null
block (padding writes land there) and is never handed out. Every other block is in exactly one
of three states:
  - free: ref count 0, no hash (`free_block_ids`, handed out first);
  - cached: ref count 0 but its hash is registered, so a later prompt can reuse its K/V
    (`evictable`, least recently freed first; evicted only when no free block is left);
  - in use: ref count = the number of sequences whose block table holds it.

Prefix caching (vLLM's automatic prefix caching): a FULL block's identity is
sha256(parent block's hash, the block's token ids, cache_salt), so equal hashes mean equal
K/V. When a block becomes full (its tokens are scheduled) its hash is registered; a new
sequence reuses the longest run of registered blocks matching its leading full blocks, but
never the block holding its last token, which must be computed to produce logits. Partially
filled blocks are never shared.

Registration happens when a step is scheduled, before that step writes the block, exactly as
in vLLM: a sequence admitted in the same step may reuse it, which is correct because a step
writes all its K/V before any attention reads them (write-then-attend, jaxpaged/model/llama.py).
So once `Scheduler.schedule()` returns, its step must run as planned.

Parallel sampling (`n > 1`): with prefix caching on, siblings share their prompt's full
blocks through the cache. `fork(parent, child)` shares them explicitly (ref counted, also with
prefix caching off): the child gets the parent's computed full prompt blocks and recomputes
its partial tail block itself, so no block is ever written by two sequences.

Host tier (`host_tier`, optional; see host_tier.py): a cached block the device evicts is first
copied to host memory under its hash; a lookup that misses on the device continues in the host
tier, and each host hit gets a fresh device block that the runner fills from host memory
before the step (`take_transfers`). A sequence preempted by swap (`swap_out`) parks its computed
blocks there and gets them back, in fresh device blocks, when it is admitted again.

Disk tier (`disk_tier`, optional, with a host tier; see disk_tier.py): before a sequence is
admitted, the blocks of its prefix that neither the device nor host memory holds but the disk
does are read into host slots (`promote_from_disk`), so the lookup finds them there.

KV events (`events`, optional; see kv_events.py): blocks registered on the device, offloaded to
the host tier, evicted from either, and resets are recorded for subscribers such as vLLM's router.
"""

import collections
import functools
import hashlib
import typing
from array import array

from jaxpaged.core.disk_tier import DiskTier
from jaxpaged.core.host_tier import HostTier, KVTransfers
from jaxpaged.core.kv_events import GPU, KVEventLog
from jaxpaged.core.sequence import Sequence

NULL_BLOCK = 0


def hash_block(parent_hash: bytes | None, token_ids: list[int], cache_salt: str | None) -> bytes:
    """The prefix-cache identity of a full block (sha256, unambiguous encoding).

    Args:
      parent_hash: hash of the previous block of the sequence, None for its first block.
      token_ids: the block's tokens.
      cache_salt: the sequence's salt, None for none.
    """
    h = hashlib.sha256(b"R" if parent_hash is None else b"C" + parent_hash)
    h.update(b"\x00" if cache_salt is None else b"\x01" + _salt_digest(cache_salt))
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@functools.lru_cache(maxsize=256)
def _salt_digest(cache_salt: str) -> bytes:
    """A salt's sha256, computed once per salt rather than once per block (a str caches its own
    hash, so a long salt costs its length only the first time)."""
    return hashlib.sha256(cache_salt.encode("utf-8", "surrogatepass")).digest()  # total: any str hashes


class ComputedPrefix(typing.NamedTuple):
    """The leading blocks a sequence can reuse at admission.

    Attributes:
      blocks: for each leading block, its device block id, or None where the host tier holds it.
      host_slots: for each leading block, its host slot where `blocks` has None, else None.
      num_tokens: tokens they hold (at most the sequence's tokens less one: the last token is
        always computed).
    """

    blocks: list[int | None]
    host_slots: list[int | None]
    num_tokens: int

    @property
    def device_blocks(self) -> list[int]:
        return [b for b in self.blocks if b is not None]


class BlockManager:
    """Hands out pool blocks to sequences; ref counts, a free list and the prefix cache.

    Attributes:
      ref_counts: `[num_blocks]` number of sequences holding each block.
      free_block_ids: ref-0 blocks without a hash, in hand-out order.
      evictable: ref-0 blocks with a registered hash, least recently freed first.
      cached_block_hash_to_block: registered hash -> block id.
      block_hash: `[num_blocks]` each block's registered hash, or None.
      prefix_cache_queries: tokens looked up in the prefix cache (vLLM's metric).
      prefix_cache_hits: of those, tokens served from the device's cache.
      host_tier: the host tier, or None.
      events: the KV event log, or None.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host_tier: HostTier | None = None,
        disk_tier: DiskTier | None = None,
        events: KVEventLog | None = None,
    ):
        """Args:
        num_blocks: pool blocks including the null block 0 (so at least 2).
        block_size: token slots per block.
        enable_prefix_caching: reuse full blocks across sequences by content hash.
        host_tier: keep evicted blocks and swapped-out sequences in host memory.
        disk_tier: find prefix blocks of earlier runs on disk (needs `host_tier`).
        events: record the prefix cache's events there (the host tier's too).
        """
        if disk_tier is not None and host_tier is None:
            raise ValueError("a disk tier reads and writes through a host tier; give host_tier too")
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.free_block_ids: collections.deque[int] = collections.deque(range(1, num_blocks))
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.cached_block_hash_to_block: dict[bytes, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.host_tier = host_tier
        self.disk_tier = disk_tier
        self.events = events
        if host_tier is not None:
            host_tier.events = events
        if disk_tier is not None:
            disk_tier.events = events
        self._num_registered: dict[int, int] = {}  # seq_id -> leading blocks already registered
        # Sequences whose K/V predates the last `reset_prefix_cache` (held or swapped out then):
        # after new weights it mixes the old weights' with the new ones', so they register nothing.
        self._stale: set[int] = set()

    # -- accounting -------------------------------------------------------------------------

    @property
    def num_total_blocks(self) -> int:
        """Blocks that can be handed out (the null block excluded)."""
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (free plus cached-but-evictable)."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (vLLM's `kv_cache_usage`)."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache lookup ----------------------------------------------------------------

    def _block_hash_of(self, seq: Sequence, i: int) -> bytes:
        """Hash of `seq`'s full block `i`, computing (and keeping) the chain up to it."""
        bs = self.block_size
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if j else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids_slice(j * bs, (j + 1) * bs), seq.cache_salt))
        return seq.block_hashes[i]

    def get_computed_blocks(self, seq: Sequence, parent: Sequence | None = None) -> ComputedPrefix:
        """Blocks `seq` can reuse at admission and how many tokens they hold; no side effects.

        A sequence swapped out reuses its swapped blocks (all in the host tier); one with a
        `parent` forks its computed full prompt blocks; otherwise the prefix cache is looked up
        block by block, on the device first and then in the host tier, until a block is in
        neither. A sequence that still needs its prompt logprobs reuses nothing (its blocks are
        still registered for others).

        Args:
          seq: a sequence holding no blocks.
          parent: fork from this sibling (same prompt) instead of looking up the prefix cache.
        """
        bs, tier = self.block_size, self.host_tier
        if tier is not None and seq.seq_id in tier.swapped:
            slots, tokens = tier.swapped[seq.seq_id]
            return ComputedPrefix([None] * len(slots), list(slots), tokens)
        if seq.needs_prompt_logprobs:
            return ComputedPrefix([], [], 0)  # every prompt position is computed (as vLLM does)
        limit = seq.num_tokens - 1
        if parent is not None:
            limit = min(limit, parent.num_computed_tokens, parent.num_prompt_tokens, seq.num_prompt_tokens)
            k = min(limit // bs, len(parent.block_table))
            while k and parent.prompt_token_ids[: k * bs] != seq.prompt_token_ids[: k * bs]:
                k -= 1
            return ComputedPrefix(parent.block_table[:k], [None] * k, k * bs)
        if not self.enable_prefix_caching:
            return ComputedPrefix([], [], 0)
        blocks, slots = [], []
        for i in range(limit // bs):
            h = self._block_hash_of(seq, i)
            block = self.cached_block_hash_to_block.get(h)
            slot = None if block is not None or tier is None else tier.lookup(h)
            if block is None and slot is None:
                break
            blocks.append(block)
            slots.append(slot)
        return ComputedPrefix(blocks, slots, len(blocks) * bs)

    def promote_from_disk(self, seq: Sequence) -> None:
        """Reads the leading blocks of `seq`'s prefix that only the disk tier holds into host
        slots (pinned until the next transfers), up to the first block held nowhere; a file that
        cannot be read ends it there too. Nothing without a disk tier."""
        disk, tier = self.disk_tier, self.host_tier
        if disk is None or not self.enable_prefix_caching or seq.seq_id in tier.swapped:
            return
        on_disk = []
        for i in range((seq.num_tokens - 1) // self.block_size):  # first pin every host hit of the prefix:
            h = self._block_hash_of(seq, i)  # the slots taken below must not evict them
            if h in self.cached_block_hash_to_block:
                continue
            slot = tier.lookup(h)
            if slot is not None:
                tier.pin([slot])
            elif disk.contains(h):
                on_disk.append(h)
            else:
                break
        for h in on_disk:
            slot = tier.cache_slot(h)
            if slot is None:
                return
            if not disk.read(h, slot):
                tier.uncache_slot(slot)
                return

    # -- verbs ------------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int | None = None, parent: Sequence | None = None) -> bool:
        """Whether `allocate(seq, parent)` then `may_append(seq, num_new_tokens)` would fit.

        Args:
          seq: a sequence holding no blocks.
          num_new_tokens: tokens to compute after the reused ones; None means all the rest.
          parent: as in `get_computed_blocks`.
        """
        prefix = self.get_computed_blocks(seq, parent)
        if num_new_tokens is None:
            num_new_tokens = seq.num_tokens - prefix.num_tokens
        device = prefix.device_blocks
        new = self._blocks_for(prefix.num_tokens + num_new_tokens) - len(device)  # host hits need blocks too
        revived = sum(1 for b in device if self.ref_counts[b] == 0)  # leave the evictable pool
        return new + revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, parent: Sequence | None = None) -> None:
        """Gives `seq` its reusable leading blocks (prefix-cache hits, a fork of `parent`, or the
        blocks it was swapped out with); host-tier blocks get fresh device blocks, filled by the
        next transfers.

        Sets `seq.block_table`, `seq.num_cached_tokens` and `seq.num_computed_tokens` (= the
        reused tokens); follow with `may_append` for the tokens to compute.
        """
        if seq.block_table:
            raise RuntimeError(f"{seq} already holds blocks")
        prefix = self.get_computed_blocks(seq, parent)
        tier = self.host_tier
        swapped = tier is not None and seq.seq_id in tier.swapped
        if self.enable_prefix_caching and parent is None and not swapped:
            device_tokens = len(prefix.device_blocks) * self.block_size
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += device_tokens
            if tier is not None:
                tier.queries += seq.num_tokens
                tier.hits += prefix.num_tokens - device_tokens
        if tier is not None:  # host slots stay put while evictions below offload other blocks
            tier.pin([s for s in prefix.host_slots if s is not None])
        for block in prefix.device_blocks:  # revived first: taking blocks below must not evict them
            if self.ref_counts[block] == 0:
                del self.evictable[block]
            self.ref_counts[block] += 1
        table = [b if b is not None else self._take_free_block() for b in prefix.blocks]
        if swapped:
            tier.swap_in(seq.seq_id, table)
        else:
            for i, slot in enumerate(prefix.host_slots):
                if slot is not None:
                    tier.load(slot, table[i])
                    self._register_block(seq, i, table[i])
        seq.block_table = table
        seq.num_cached_tokens = seq.num_computed_tokens = prefix.num_tokens
        # A swapped-in sequence registers its full blocks again as `may_append` reaches them.
        self._num_registered[seq.seq_id] = 0 if swapped else len(table)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `may_append(seq, num_new_tokens)` would find enough free blocks."""
        return self._blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table) <= self.num_free_blocks

    def may_append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Extends `seq.block_table` to hold `num_computed_tokens + num_new_tokens` tokens.

        Blocks that become full with these tokens are registered in the prefix cache.

        Raises:
          RuntimeError: when the pool is out of blocks (check `can_append` first).
        """
        need = self._blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > self.num_free_blocks:
            raise RuntimeError(f"out of KV blocks: {seq} needs {need}, {self.num_free_blocks} free")
        for _ in range(need):
            seq.block_table.append(self._take_free_block())
        if self.enable_prefix_caching:
            full = min(seq.num_computed_tokens + num_new_tokens, seq.num_tokens) // self.block_size
            self._register(seq, full)

    def can_append_from_free(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `may_append(seq, num_new_tokens)` finds its blocks among the free ones alone,
        evicting no cached block (what speculative proposals may take)."""
        return self._blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table) <= len(
            self.free_block_ids
        )

    def trim(self, seq: Sequence) -> None:
        """Frees the blocks of `seq.block_table` past its computed tokens: after a step that
        checked proposals, those held only rejected ones. They were never registered (a block is
        registered from the sequence's own tokens only) and nobody else holds them.

        When it frees any, `seq.block_table` becomes a new list: whoever mirrors a table (the
        step packer) sees by its identity that entries it already copied changed."""
        keep = self._blocks_for(seq.num_computed_tokens)
        if keep == len(seq.block_table):
            return
        for block in seq.block_table[keep:]:
            if self.ref_counts[block] != 1 or self.block_hash[block] is not None:
                raise RuntimeError(f"block {block} past {seq}'s computed tokens is shared or cached")
            self.ref_counts[block] = 0
            self.free_block_ids.append(block)
        seq.block_table = seq.block_table[:keep]

    def deallocate(self, seq: Sequence) -> None:
        """Releases `seq`'s blocks; those left unreferenced stay cached if they have a hash.

        Blocks are released last-first, so a sequence's tail is evicted before its prefix.
        Sets `seq.block_table = []` (a new list) and `seq.num_computed_tokens = 0`.
        """
        self._release(seq)
        self._stale.discard(seq.seq_id)
        if self.host_tier is not None:
            self.host_tier.drop_swapped(seq.seq_id)

    def _release(self, seq: Sequence) -> None:
        """`deallocate`'s release of the device blocks (a sequence swapped out keeps the rest)."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is not None:
                    self.evictable[block] = None
                else:
                    self.free_block_ids.append(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._num_registered.pop(seq.seq_id, None)

    def swap_out(self, seq: Sequence) -> bool:
        """Preemption by swap: plans copying `seq`'s computed blocks to the host tier and releases
        its device blocks (`deallocate`); on its next `allocate` it gets them back. False, with
        nothing done, when there is no host tier or it cannot take them all."""
        if self.host_tier is None:
            return False
        computed = seq.num_computed_tokens
        blocks = seq.block_table[: self._blocks_for(computed)]
        if not blocks or len(blocks) > self.host_tier.num_available:
            return False
        self._release(seq)  # bookkeeping only: the offloads read the blocks before any step writes them
        return self.host_tier.swap_out(seq.seq_id, blocks, computed)

    def take_transfers(self) -> KVTransfers:
        """The device<->host copies planned since the last call; run them before the next step."""
        if self.host_tier is None:
            return KVTransfers([], [])
        return self.host_tier.take_transfers()

    def take_stores(self) -> KVTransfers:
        """After a step: copies of the blocks it computed into the host tier, when the tier writes
        through (for the disk tier); none otherwise."""
        if self.host_tier is None:
            return KVTransfers([], [])
        return self.host_tier.take_stores()

    def reset_prefix_cache(self) -> None:
        """Forgets every registered hash; cached blocks become free (vLLM's `reset_prefix_cache`),
        in the host tier too. The disk tier keeps its files: the next lookups read them again.
        The sequences holding blocks or swapped out now register no more of them, also after
        they are swapped back in: after new weights (`update_weights`) their KV mixes the old
        weights' with the new ones'."""
        self._stale.update(self._num_registered)
        if self.host_tier is not None:
            self._stale.update(self.host_tier.swapped)
        self.free_block_ids.extend(self.evictable)
        self.evictable.clear()
        self.cached_block_hash_to_block.clear()
        self.block_hash = [None] * self.num_blocks
        if self.host_tier is not None:
            self.host_tier.clear_cached()
        if self.events is not None:
            self.events.cleared()

    # -- internals --------------------------------------------------------------------------

    def _take_free_block(self) -> int:
        if self.free_block_ids:
            block = self.free_block_ids.popleft()
        else:  # evict the least recently freed cached block (to the host tier, if any)
            block, _ = self.evictable.popitem(last=False)
            block_hash = self.block_hash[block]
            del self.cached_block_hash_to_block[block_hash]
            self.block_hash[block] = None
            if self.host_tier is not None:
                self.host_tier.offload(block, block_hash)
            if self.events is not None:  # after the offload: that announces the host copy first
                self.events.removed(block_hash, GPU)
        self.ref_counts[block] = 1
        return block

    def _register(self, seq: Sequence, num_full_blocks: int) -> None:
        if seq.seq_id in self._stale:
            return
        start = self._num_registered.get(seq.seq_id, 0)
        for i in range(start, num_full_blocks):
            self._register_block(seq, i, seq.block_table[i])
        self._num_registered[seq.seq_id] = max(start, num_full_blocks)

    def _register_block(self, seq: Sequence, i: int, block: int) -> None:
        """Registers device `block` as `seq`'s full block `i`."""
        block_hash = self._block_hash_of(seq, i)
        # Equal content already cached elsewhere (e.g. the last-token block that a fully cached
        # prompt recomputes): keep that one; this block stays unhashed.
        if block_hash not in self.cached_block_hash_to_block and self.block_hash[block] is None:
            self.cached_block_hash_to_block[block_hash] = block
            self.block_hash[block] = block_hash
            if self.host_tier is not None:
                self.host_tier.registered(block, block_hash)
            if self.events is not None:
                bs = self.block_size
                parent = seq.block_hashes[i - 1] if i else None
                tokens = seq.token_ids_slice(i * bs, (i + 1) * bs)
                self.events.stored(block_hash, parent, tokens, seq.lora_name, GPU)
