"""The disk tier of the KV cache: blocks of the host tier kept as files that outlive the engine
(host only, no JAX here).

With a disk tier the host tier writes through (every block registered in the device's prefix
cache is copied to host memory once computed, see host_tier.py) and every block that reaches a
host slot under a prefix hash is also written to `<kv_cache_dir>/<fingerprint>/<hash>.kv` by a
background thread. A later engine, in this process or another, with the same fingerprint (the
model's configuration, its weights' identity, the dtypes, the block size and the layout of a
block) finds the files at start-up; a prefix lookup that misses on the device and in host memory
reads the next blocks from disk into host slots (`promote`), from where they are loaded like any
host hit.

Files are written atomically (a temporary file in the same directory, then a rename). Each holds
a header (magic, format, fingerprint, block hash, payload length, CRC-32 of the payload) and
the block's bytes. A file that is truncated, corrupt, or from another fingerprint is detected
when read: it is removed with a warning, and the block is computed again instead. The directory
is kept under `capacity_bytes` by removing the least recently used files.
"""

import collections
import logging
import os
import queue
import struct
import threading
import time
import zlib

import numpy as np

logger = logging.getLogger("jaxpaged")

MAGIC = b"JXPGKV\x00\x01"
_HEADER = struct.Struct("<8s32s32sQI")  # magic, fingerprint, block hash, payload bytes, CRC-32
SUFFIX = ".kv"
# Blocks waiting to be written; beyond this, new writes are dropped (counted) rather than
# letting the engine's memory grow when the disk is slower than the traffic.
MAX_PENDING_WRITES = 1024


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
      read_bytes, write_bytes: bytes read and written.
      rejected: files found unreadable (truncated, corrupt, another fingerprint) and removed.
      dropped_writes: writes skipped because too many were pending.
    """

    def __init__(self, directory: str, fingerprint: bytes, capacity_bytes: int, memory: np.ndarray):
        if len(fingerprint) != 32:
            raise ValueError(f"a fingerprint is 32 bytes, got {len(fingerprint)}")
        self.fingerprint = fingerprint
        self.directory = os.path.join(directory, fingerprint.hex()[:32])
        self.capacity_bytes = capacity_bytes
        self.memory = memory
        self.file_bytes = _HEADER.size + memory[0].nbytes
        self.hits = self.read_bytes = self.write_bytes = self.rejected = self.dropped_writes = 0
        self._lock = threading.Lock()
        self._files: collections.OrderedDict[bytes, None] = collections.OrderedDict()  # LRU first
        self._queue: queue.Queue = queue.Queue()
        os.makedirs(self.directory, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="jaxpaged-kv-disk", daemon=True)
        self._writer.start()

    # -- lookups and reads (engine thread) -----------------------------------------------------

    @property
    def num_files(self) -> int:
        return len(self._files)

    def contains(self, block_hash: bytes) -> bool:
        """Whether a file for `block_hash` is known (it may still turn out unreadable)."""
        return block_hash in self._files

    def read(self, block_hash: bytes, slot: int) -> bool:
        """Reads the block's file into host slot `slot`; False (file removed, warning logged) if it
        is missing, truncated, corrupt or of another fingerprint."""
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                payload = f.read(self.memory[slot].nbytes + 1)
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
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
        os.utime(path)  # least recently used across processes too
        self.hits += 1
        self.read_bytes += len(payload)
        return True

    # -- writes (queued; a background thread writes) -------------------------------------------

    def save(self, block_hash: bytes, slot: int) -> None:
        """Queues writing host slot `slot` (a copy of it, taken now) as the file of `block_hash`;
        nothing if the file exists."""
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
                return
        if self._queue.qsize() >= MAX_PENDING_WRITES:
            self.dropped_writes += 1
            return
        self._queue.put((block_hash, self.memory[slot].tobytes()))

    def flush(self, timeout: float = 60.0) -> None:
        """Waits until every queued write is on disk (tests, and before a process exits)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    # -- internals -------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> str:
        return os.path.join(self.directory, block_hash.hex() + SUFFIX)

    def _reject(self, block_hash: bytes, why: str) -> bool:
        logger.warning("KV cache file %s %s; ignored, removed, and its block computed again", self._path(block_hash), why)
        with self._lock:
            self._files.pop(block_hash, None)
        try:
            os.remove(self._path(block_hash))
        except OSError:
            pass
        self.rejected += 1
        return False

    def _scan(self) -> None:
        """Knows the files already there (oldest first); removes temporaries of interrupted writes."""
        found = []
        for entry in os.scandir(self.directory):
            if entry.name.endswith(".tmp"):
                os.remove(entry.path)
                continue
            name = entry.name.removesuffix(SUFFIX)
            if entry.name.endswith(SUFFIX) and len(name) == 64:
                try:
                    found.append((entry.stat().st_mtime_ns, bytes.fromhex(name)))
                except ValueError:
                    continue
        for _, block_hash in sorted(found):
            self._files[block_hash] = None
        self._evict()
        if self._files:
            logger.info("KV cache directory %s: %d blocks from earlier runs", self.directory, len(self._files))

    def _evict(self) -> None:
        with self._lock:
            victims = []
            while self._files and len(self._files) * self.file_bytes > self.capacity_bytes:
                victims.append(self._files.popitem(last=False)[0])
        for block_hash in victims:
            try:
                os.remove(self._path(block_hash))
            except OSError:
                pass

    def _write_loop(self) -> None:
        while True:
            block_hash, payload = self._queue.get()
            try:
                self._write(block_hash, payload)
            except OSError as err:  # a full or read-only disk loses the cache, never the engine
                logger.warning("could not write KV cache file %s: %s", self._path(block_hash), err)
            finally:
                self._queue.task_done()

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        path = self._path(block_hash)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, self.fingerprint, block_hash, len(payload), zlib.crc32(payload)))
            f.write(payload)
        os.replace(tmp, path)
        with self._lock:
            self._files[block_hash] = None
            self._files.move_to_end(block_hash)
        self.write_bytes += len(payload)
        self._evict()
