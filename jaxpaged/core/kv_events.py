"""The prefix cache's events, as vLLM's KV events name them (host only, no JAX here).

A block is *stored* in a tier (medium) when its hash becomes findable there: registered on the
device (`GPU`), offloaded to host memory (`CPU`) or written to the disk tier (`DISK`, by its
writer thread: the events go out with the next step's); it is *removed* from a tier when that
tier forgets it (evicted, a file rejected, or the tier cleared). Only blocks this engine
announced move between tiers: files found on disk from earlier runs (or written by other
processes sharing the directory) are not announced. A reset of the prefix cache clears every
tier at once (`AllBlocksCleared`). `jaxpaged.engine.kv_event_publisher`
sends them; a subscriber such as vLLM's router rebuilds from them which prefixes an engine holds.

Hashes go out as vLLM sends them by default: the last 8 bytes of the engine's sha256 block hash
as an unsigned big-endian integer. A store names its parent block's hash and carries the block's
token ids, so a subscriber can hash the tokens its own way and chain the blocks.
"""

import dataclasses
import threading

GPU, CPU, DISK = "GPU", "CPU", "DISK"


def external_hash(block_hash: bytes) -> int:
    """A block hash as KV events carry it (vLLM's integer form: its last 8 bytes, big-endian)."""
    return int.from_bytes(block_hash[-8:], "big")


@dataclasses.dataclass
class BlockStored:
    """Consecutive full blocks of one sequence newly held in `medium`.

    Attributes:
      block_hashes: the blocks' hashes, first to last (`external_hash`).
      parent_block_hash: the hash of the block before the first, None for a sequence's first.
      token_ids: the blocks' tokens, `block_size` per block.
      block_size: tokens per block.
      lora_name: the LoRA adapter the blocks were computed with, or None.
      medium: GPU, CPU or DISK.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    medium: str


@dataclasses.dataclass
class BlockRemoved:
    """Blocks `medium` no longer holds."""

    block_hashes: list[int]
    medium: str


@dataclasses.dataclass
class AllBlocksCleared:
    """Every tier forgot every block (the prefix cache was reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """Records the block manager's and tiers' events until the engine takes them (each step).

    It remembers each held block's parent and tokens (while some tier holds it), so a block
    that moves to another tier is announced there with them. Thread-safe (the disk tier's writer
    records its stores and evictions from its own thread).
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._events: list[KVEvent] = []
        self._blocks: dict[bytes, tuple[bytes | None, tuple[int, ...], str | None, set[str]]] = {}
        self._lock = threading.Lock()

    def stored(
        self, block_hash: bytes, parent: bytes | None, token_ids: list[int], lora_name: str | None, medium: str
    ) -> None:
        """A block newly findable in `medium` (its parent's hash, its tokens, its adapter)."""
        with self._lock:
            entry = self._blocks.setdefault(block_hash, (parent, tuple(token_ids), lora_name, set()))
            entry[3].add(medium)
            self._store(block_hash, entry[0], entry[1], entry[2], medium)

    def moved(self, block_hash: bytes, medium: str) -> None:
        """A block already announced elsewhere now held in `medium` too (e.g. offloaded to host
        memory as the device evicts it); nothing for a block never announced."""
        with self._lock:
            entry = self._blocks.get(block_hash)
            if entry is not None and medium not in entry[3]:
                entry[3].add(medium)
                self._store(block_hash, entry[0], entry[1], entry[2], medium)

    def removed(self, block_hash: bytes, medium: str) -> None:
        """`medium` forgot a block it held."""
        with self._lock:
            entry = self._blocks.get(block_hash)
            if entry is None or medium not in entry[3]:
                return
            entry[3].discard(medium)
            if not entry[3]:
                del self._blocks[block_hash]
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockRemoved) and last.medium == medium:
                last.block_hashes.append(external_hash(block_hash))
            else:
                self._events.append(BlockRemoved([external_hash(block_hash)], medium))

    def cleared(self) -> None:
        """Every tier forgot everything."""
        with self._lock:
            self._blocks.clear()
            self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """The events since the last call, in order."""
        with self._lock:
            events, self._events = self._events, []
        return events

    def _store(
        self, block_hash: bytes, parent: bytes | None, tokens: tuple[int, ...], lora_name: str | None, medium: str
    ) -> None:
        """Appends a store, extending the last one where this block continues it (vLLM sends a
        sequence's consecutive blocks as one event)."""
        last = self._events[-1] if self._events else None
        parent_hash = None if parent is None else external_hash(parent)
        if (
            isinstance(last, BlockStored)
            and last.medium == medium
            and last.lora_name == lora_name
            and parent_hash is not None
            and last.block_hashes[-1] == parent_hash
        ):
            last.block_hashes.append(external_hash(block_hash))
            last.token_ids.extend(tokens)
        else:
            event = BlockStored(
                [external_hash(block_hash)], parent_hash, list(tokens), self.block_size, lora_name, medium
            )
            self._events.append(event)
