"""The host tier of the KV cache: pool blocks' K/V kept in host memory (host only, no JAX here).

The device pool's prefix cache forgets a block when it evicts it; with a host tier the block's
K/V are copied to a host slot first, keyed by the same prefix hash (sha256 chain with the
cache salt, `block_manager.hash_block`), and a later prompt with that prefix copies them back
instead of recomputing them. A sequence preempted by swap parks its computed blocks here too.

Every host slot is in exactly one state:
  - free;
  - cached: a full block's K/V under its prefix hash (`cached`, least recently used first;
    evicted when a slot is needed and none is free);
  - swapped: one of a preempted sequence's blocks, held for it until it resumes or ends.

The tier only plans copies; the runner carries them out (`take_transfers`) before the step
that `Scheduler.schedule()` planned, in this order:
  1. offloads (device block -> host slot): they read device blocks before this step, or a load,
     overwrites them;
  2. loads (host slot -> device block).
A slot that a pending load reads is pinned: no offload or swap takes it until the transfers
ran. Slots a resumed sequence was swapped into are freed once its loads are handed out.

Write-through (`write_through`, for the disk tier): every block registered in the device's prefix
cache is also copied here once it is computed. Registration happens when a step is scheduled,
before that step computes the block, so these copies are handed over after the step ran
(`take_stores`), before any later step can overwrite the block.
"""

import collections
import dataclasses

from jaxpaged.core.kv_events import CPU, KVEventLog


@dataclasses.dataclass(frozen=True)
class KVTransfers:
    """Copies between the device pool and the host tier, to run before the next step.

    Attributes:
      offloads: `(device block, host slot)` pairs, run first.
      loads: `(host slot, device block)` pairs, run after the offloads.
    """

    offloads: list[tuple[int, int]]
    loads: list[tuple[int, int]]

    def __bool__(self) -> bool:
        return bool(self.offloads or self.loads)


class HostTier:
    """Slots of host memory for KV blocks: an LRU prefix cache and swap space.

    Attributes:
      num_slots: host slots (blocks) in the tier.
      cached: prefix hash -> slot, least recently used first.
      swapped: seq_id -> (its slots in block order, tokens they hold).
      hits: tokens served from the tier to prefix lookups (vLLM's external prefix-cache hits).
      queries: tokens of the prompts looked up while a host hit was possible.
      offloaded_blocks, loaded_blocks: blocks copied to and from the device so far.
      swapped_out_blocks, swapped_in_blocks: of those, blocks of preempted sequences.
    """

    def __init__(self, num_slots: int, write_through: bool = False):
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.write_through = write_through
        self.cached: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.swapped: dict[int, tuple[list[int], int]] = {}
        self.hits = self.queries = 0
        self.offloaded_blocks = self.loaded_blocks = 0
        self.swapped_out_blocks = self.swapped_in_blocks = 0
        self._free: collections.deque[int] = collections.deque(range(num_slots))
        self._slot_hash: dict[int, bytes] = {}
        self._pinned: set[int] = set()
        self._release_after: list[int] = []  # swap slots to free once their loads are handed out
        self._offloads: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._stores: list[tuple[int, bytes]] = []  # registered for this step: copied after it
        self.events: KVEventLog | None = None  # the block manager's KV event log, if any

    # -- accounting -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Slots an offload or swap could take now: free ones and unpinned cached ones."""
        return len(self._free) + sum(1 for s in self.cached.values() if s not in self._pinned)

    @property
    def num_swapped(self) -> int:
        return sum(len(slots) for slots, _ in self.swapped.values())

    # -- prefix cache -----------------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot caching `block_hash`, or None; no side effects."""
        return self.cached.get(block_hash)

    def hash_of(self, slot: int) -> bytes | None:
        """The prefix hash a cached slot holds (None for a free or swapped slot)."""
        return self._slot_hash.get(slot)

    def registered(self, device_block: int, block_hash: bytes) -> None:
        """A device block was registered under `block_hash` (the step being scheduled computes
        it); with `write_through` it is copied here after that step (`take_stores`)."""
        if self.write_through:
            self._stores.append((device_block, block_hash))

    def cache_slot(self, block_hash: bytes) -> int | None:
        """A slot for a block that arrives from elsewhere (the disk tier) under `block_hash`, now
        cached and pinned until the next hand-over; None when no slot can be had."""
        if block_hash in self.cached:
            return None
        slot = self._take_slot()
        if slot is not None:
            self.cached[block_hash] = slot
            self._slot_hash[slot] = block_hash
            if self.events is not None:
                self.events.moved(block_hash, CPU)
        return slot

    def uncache_slot(self, slot: int) -> None:
        """Takes back a `cache_slot` whose block could not be read."""
        block_hash = self._slot_hash.pop(slot)
        del self.cached[block_hash]
        if self.events is not None:
            self.events.removed(block_hash, CPU)
        self._pinned.discard(slot)
        self._free.append(slot)

    def offload(self, device_block: int, block_hash: bytes) -> None:
        """Keeps an evicted device block: plans its copy into a slot under `block_hash` (evicting
        the least recently used cached slot if none is free). A hash already cached is only
        marked recently used; with every slot pinned or swapped the block is dropped."""
        if block_hash in self.cached:
            self.cached.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return
        self.cached[block_hash] = slot
        self._slot_hash[slot] = block_hash
        if self.events is not None:
            self.events.moved(block_hash, CPU)
        self._offloads.append((device_block, slot))
        self.offloaded_blocks += 1

    def load(self, slot: int, device_block: int) -> None:
        """Plans copying cached `slot` into `device_block`; pins the slot until the transfers ran."""
        self.cached.move_to_end(self._slot_hash[slot])
        self._pin_and_load(slot, device_block)

    def pin(self, slots: list[int]) -> None:
        """Keeps `slots` from being taken until the transfers ran (a lookup's hits, before the
        device blocks for them are taken, which may offload evicted blocks)."""
        self._pinned.update(slots)

    def clear_cached(self) -> None:
        """Forgets every cached block (not swapped ones) but those a pending load reads, which
        stay cached."""
        for block_hash, slot in list(self.cached.items()):
            if slot not in self._pinned:
                del self.cached[block_hash]
                del self._slot_hash[slot]
                self._free.append(slot)

    # -- swap -------------------------------------------------------------------------------

    def swap_out(self, seq_id: int, device_blocks: list[int], num_tokens: int) -> bool:
        """Plans copying a preempted sequence's computed blocks out; False (nothing planned) when
        the tier cannot take them all.

        Args:
          seq_id: the sequence.
          device_blocks: its blocks holding `num_tokens` computed tokens, in order.
          num_tokens: the computed tokens they hold.
        """
        if seq_id in self.swapped:
            raise RuntimeError(f"sequence {seq_id} is already swapped out")
        if len(device_blocks) > self.num_available:
            return False
        slots = [self._take_slot() for _ in device_blocks]
        self._offloads.extend(zip(device_blocks, slots))
        self.swapped[seq_id] = (slots, num_tokens)
        self.offloaded_blocks += len(slots)
        self.swapped_out_blocks += len(slots)
        return True

    def swap_in(self, seq_id: int, device_blocks: list[int]) -> None:
        """Plans copying a swapped sequence's blocks back into `device_blocks` (one per slot);
        its slots are freed once the transfers are handed out."""
        slots, _ = self.swapped.pop(seq_id)
        if len(slots) != len(device_blocks):
            raise ValueError(f"sequence {seq_id} swapped {len(slots)} blocks, got {len(device_blocks)} to load")
        for slot, block in zip(slots, device_blocks):
            self._pin_and_load(slot, block)
        self._release_after.extend(slots)
        self.swapped_in_blocks += len(slots)

    def drop_swapped(self, seq_id: int) -> None:
        """Frees the slots of a swapped-out sequence that ended (aborted) before resuming."""
        slots, _ = self.swapped.pop(seq_id, ((), 0))
        for slot in slots:
            if slot in self._pinned:  # a pending offload still writes it this step
                self._release_after.append(slot)
            else:
                self._free.append(slot)

    # -- hand-over to the runner ------------------------------------------------------------

    def take_transfers(self) -> KVTransfers:
        """The copies planned since the last call (run them before the next step), in order;
        unpins the slots they read."""
        transfers = KVTransfers(self._offloads, self._loads)
        self._offloads, self._loads = [], []
        self._pinned.clear()
        self._free.extend(self._release_after)
        self._release_after = []
        return transfers

    def take_stores(self) -> KVTransfers:
        """With `write_through`: the copies of the blocks registered for the step that just ran
        (computed now); run them before the next step. Call right after each step."""
        stores, self._stores = self._stores, []
        for block, block_hash in stores:
            self.offload(block, block_hash)
        return self.take_transfers()

    # -- internals --------------------------------------------------------------------------

    def _pin_and_load(self, slot: int, device_block: int) -> None:
        self._pinned.add(slot)
        self._loads.append((slot, device_block))
        self.loaded_blocks += 1

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used unpinned cached one (forgotten); pinned."""
        if self._free:
            slot = self._free.popleft()
        else:
            victim = next((h for h, s in self.cached.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self.cached.pop(victim)
            del self._slot_hash[slot]
            if self.events is not None:
                self.events.removed(victim, CPU)
        self._pinned.add(slot)  # written by this step's offloads: nothing else takes it now
        return slot
