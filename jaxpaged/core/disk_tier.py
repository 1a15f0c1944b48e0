"""The disk tier of the KV cache: blocks of the host tier kept as files that outlive the engine
(host only, no JAX here).

With a disk tier the host tier writes through (every block registered in the device's prefix
cache is copied to host memory once computed, see host_tier.py) and every block that reaches a
host slot under a prefix hash is also written to `<kv_cache_dir>/<fingerprint>/<hash>.kv` by a
background thread. A later engine, in this process or another, with the same fingerprint (the
model's configuration, its weights' identity, the dtypes, the layout of a block and what else
decides the K/V values) finds the files at start-up; a prefix lookup that misses on the device
and in host memory reads the next blocks from disk into host slots
(`BlockManager.promote_from_disk`), from where they are loaded like any host hit.

Files are written atomically (a temporary file in the same directory, then a rename). Each holds
a header (magic, format, fingerprint, block hash, payload length, CRC-32 of the payload) and
the block's bytes. A file that is truncated, corrupt, or from another fingerprint is detected
when read: it is removed with a warning, and the block is computed again instead. The directory
is kept under `capacity_bytes` by removing the least recently used files. A disk that fails
(full, read-only, files removed by another process) loses cached blocks, never the engine.
"""

import collections
import logging
import os
import queue
import struct
import threading
import time
import weakref
import zlib

import numpy as np

from jaxpaged.core.kv_events import DISK, KVEventLog

logger = logging.getLogger("jaxpaged")

MAGIC = b"JXPGKV\x00\x01"
_HEADER = struct.Struct("<8s32s32sQI")  # magic, fingerprint, block hash, payload bytes, CRC-32
SUFFIX = ".kv"
# Bytes waiting to be written; beyond this, new writes are dropped (counted) rather than letting
# the engine's memory grow when the disk is slower than the traffic.
MAX_PENDING_BYTES = 1 << 30
# A temporary file older than this is an interrupted write (of any process sharing the directory).
STALE_TMP_SECONDS = 600


class _BlockFiles:
    """The files of one fingerprint: the LRU index, the size cap, and the writer thread. Holds
    no host memory (the writer gets copies), so a `DiskTier` can be collected while it runs."""

    def __init__(self, directory: str, fingerprint: bytes, capacity_bytes: int, file_bytes: int):
        self.directory, self.fingerprint = directory, fingerprint
        self.capacity_bytes, self.file_bytes = capacity_bytes, file_bytes
        self.write_bytes = self.dropped_writes = 0
        self.events: KVEventLog | None = None  # the block manager's KV event log, if any
        self.lock = threading.Lock()
        self.index: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # LRU first
        self._pending: set[bytes] = set()
        self._pending_bytes = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="jaxpaged-kv-disk", daemon=True)
        self._thread.start()

    def path(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, block_hash.hex() + SUFFIX)

    def touch(self, block_hash: bytes) -> None:
        with self.lock:
            if block_hash in self.index:
                self.index.move_to_end(block_hash)

    def forget(self, block_hash: bytes, remove: bool) -> None:
        with self.lock:
            self.index.pop(block_hash, None)
        if self.events is not None:
            self.events.removed(block_hash, DISK)
        if remove:
            try:
                os.remove(self.path(block_hash))
            except OSError:
                pass

    def known(self, block_hash: bytes) -> bool:
        """Whether the block has a file or a queued write (a file is marked recently used)."""
        with self.lock:
            if block_hash in self.index:
                self.index.move_to_end(block_hash)
                return True
            return block_hash in self._pending

    def enqueue(self, block_hash: bytes, payload: bytes) -> None:
        with self.lock:
            if block_hash in self.index or block_hash in self._pending:
                return
            if self._pending_bytes + len(payload) > MAX_PENDING_BYTES:
                self.dropped_writes += 1
                return
            self._pending.add(block_hash)
            self._pending_bytes += len(payload)
        self._queue.put((block_hash, payload))

    def flush(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.005)

    def stop(self) -> None:
        """Writes what is queued, then ends the writer thread."""
        self._queue.put(None)
        self._thread.join(timeout=60)

    def scan(self) -> None:
        """Knows the files already there (oldest first); removes stale temporaries."""
        found = []
        for entry in os.scandir(self.directory):
            try:
                if entry.name.endswith(".tmp"):
                    if time.time() - entry.stat().st_mtime > STALE_TMP_SECONDS:
                        os.remove(entry.path)
                    continue
                name = entry.name.removesuffix(SUFFIX)
                if entry.name.endswith(SUFFIX) and len(name) == 64:
                    found.append((entry.stat().st_mtime_ns, bytes.fromhex(name)))
            except (OSError, ValueError):  # renamed or removed meanwhile by another process; not a hash
                continue
        with self.lock:
            for _, block_hash in sorted(found):
                self.index[block_hash] = None
        self.evict()

    def evict(self) -> None:
        with self.lock:
            victims = []
            while self.index and len(self.index) * self.file_bytes > self.capacity_bytes:
                victims.append(self.index.popitem(last=False)[0])
        for block_hash in victims:
            if self.events is not None:
                self.events.removed(block_hash, DISK)
            try:
                os.remove(self.path(block_hash))
            except OSError:
                pass

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as err:  # noqa: BLE001 (a full or read-only disk loses the cache, never the engine)
                logger.warning("could not write KV cache file %s: %s", self.path(item[0]), err)
            finally:
                if item is not None:
                    with self.lock:
                        self._pending.discard(item[0])
                        self._pending_bytes -= len(item[1])
                self._queue.task_done()

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        path = self.path(block_hash)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, self.fingerprint, block_hash, len(payload), zlib.crc32(payload)))
            f.write(payload)
        os.replace(tmp, path)
        with self.lock:
            self.index[block_hash] = None
            self.index.move_to_end(block_hash)
        if self.events is not None:
            self.events.moved(block_hash, DISK)
        self.write_bytes += len(payload)
        self.evict()


class DiskTier:
    """Block files of one fingerprint in a directory, with an LRU size cap.

    Args:
      directory: the cache directory (`kv_cache_dir`); this tier uses a subdirectory named after
        the fingerprint.
      fingerprint: 32 bytes naming what the blocks' bytes depend on (see module doc).
      capacity_bytes: most bytes of files kept.
      memory: the host tier's memory, `[slots, ...]`: blocks are written from and read into it.

    Attributes:
      hits: blocks read back from disk.
      read_bytes: bytes read.
      rejected: files found unreadable (truncated, corrupt, another fingerprint) and removed.
    """

    def __init__(self, directory: str, fingerprint: bytes, capacity_bytes: int, memory: np.ndarray):
        if len(fingerprint) != 32:
            raise ValueError(f"a fingerprint is 32 bytes, got {len(fingerprint)}")
        self.fingerprint = fingerprint
        self.directory = os.path.join(directory, fingerprint.hex()[:32])
        self.capacity_bytes = capacity_bytes
        self.memory = memory
        self.file_bytes = _HEADER.size + memory[0].nbytes
        self.hits = self.read_bytes = self.rejected = 0
        os.makedirs(self.directory, exist_ok=True)
        self._files = _BlockFiles(self.directory, fingerprint, capacity_bytes, self.file_bytes)
        self._files.scan()
        # The writer thread holds only the file index: once this tier is unreachable, it stops.
        self._finalizer = weakref.finalize(self, self._files.stop)
        if self._files.index:
            logger.info("KV cache directory %s: %d blocks from earlier runs", self.directory, len(self._files.index))

    @property
    def events(self) -> KVEventLog | None:
        """The KV event log that hears of this tier's files (written: stored; evicted or rejected:
        removed), or None."""
        return self._files.events

    @events.setter
    def events(self, log: KVEventLog | None) -> None:
        self._files.events = log

    @property
    def num_files(self) -> int:
        return len(self._files.index)

    @property
    def write_bytes(self) -> int:
        return self._files.write_bytes

    @property
    def dropped_writes(self) -> int:
        """Writes skipped because too many bytes were pending."""
        return self._files.dropped_writes

    def contains(self, block_hash: bytes) -> bool:
        """Whether a file for `block_hash` is known (it may still turn out unreadable)."""
        return block_hash in self._files.index

    def read(self, block_hash: bytes, slot: int) -> bool:
        """Reads the block's file into host slot `slot`; False if it is gone, or (file removed,
        warning logged) truncated, corrupt or of another fingerprint."""
        self._files.touch(block_hash)  # most recently used: not the next file the cap removes
        path = self._files.path(block_hash)
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                payload = f.read(self.memory[slot].nbytes + 1)
        except FileNotFoundError:  # removed meanwhile (the cap, another process): a plain miss
            self._files.forget(block_hash, remove=False)
            return False
        except OSError as err:
            return self._reject(block_hash, f"cannot be read ({err.strerror})")
        if len(header) < _HEADER.size:
            return self._reject(block_hash, "is truncated (no header)")
        magic, fingerprint, stored_hash, length, crc = _HEADER.unpack(header)
        if magic != MAGIC:
            return self._reject(block_hash, "is not a jaxpaged KV block file (or of another format version)")
        if fingerprint != self.fingerprint or stored_hash != block_hash:
            return self._reject(block_hash, "belongs to another model, dtype, block size or block")
        if length != self.memory[slot].nbytes or len(payload) != length:
            return self._reject(block_hash, f"is truncated or of another size ({len(payload)} of {length} bytes)")
        if zlib.crc32(payload) != crc:
            return self._reject(block_hash, "is corrupt (checksum mismatch)")
        self.memory[slot].reshape(-1).view(np.uint8)[:] = np.frombuffer(payload, np.uint8)
        try:
            os.utime(path)  # least recently used across processes too
        except OSError:  # removed meanwhile, or a directory we may read but not write: no matter
            pass
        self.hits += 1
        self.read_bytes += len(payload)
        return True

    def save(self, block_hash: bytes, slot: int) -> None:
        """Queues writing host slot `slot` (a copy of it, taken now) as the file of `block_hash`;
        nothing if the file exists or is queued already."""
        if not self._files.known(block_hash):  # before copying the slot
            self._files.enqueue(block_hash, self.memory[slot].tobytes())

    def flush(self, timeout: float = 60.0) -> None:
        """Waits until every queued write is on disk (tests, benchmarks)."""
        self._files.flush(timeout)

    def close(self) -> None:
        """Writes what is queued and stops the writer thread (also done when the tier is collected
        or the process exits)."""
        self._finalizer()

    def _reject(self, block_hash: bytes, why: str) -> bool:
        logger.warning(
            "KV cache file %s %s; ignored, removed, and its block computed again", self._files.path(block_hash), why
        )
        self._files.forget(block_hash, remove=True)
        self.rejected += 1
        return False
