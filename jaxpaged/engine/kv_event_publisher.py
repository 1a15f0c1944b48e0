"""Sends the prefix cache's KV events over ZeroMQ in vLLM's wire format (its `ZmqEventPublisher`).

Each engine step's events (`Scheduler.take_kv_events`) go out as one batch, a message of three
frames on a PUB socket: `[topic, seq, payload]`, `seq` the batch's number (8 bytes big-endian,
from 0) and `payload` the msgpack of `encode_batch`: an array `[ts, events, data_parallel_rank]`,
each event a map tagged by its "type": what vllm-router 0.1.17 decodes (vLLM's current publisher
writes the same events but the batch as a map, which that router refuses). With a `replay_endpoint`, a ROUTER
socket answers a subscriber's `[b"", start_seq]` (a DEALER's) with every batch still buffered
from `start_seq` on, `[b"", topic, seq, payload]` each, then `[b"", topic, -1, b""]`: the frames
vllm-router 0.1.17 reads (vLLM's own replay leaves the topic out, and the router ignores it).
docs/server.md#kv-events says which fields carry what.
"""

import logging
import queue
import threading
import time
from collections import deque

from jaxpaged.config.kv_events import KVEventsConfig
from jaxpaged.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def encode_event(event: KVEvent) -> dict:
    """One event as vLLM's tagged struct: a map with its class name under "type"."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {event!r}")


def encode_batch(events: list[KVEvent], ts: float, data_parallel_rank: int = 0) -> bytes:
    """A batch's payload: the msgpack of vLLM's `KVEventBatch` (ts, events, data_parallel_rank)."""
    import msgpack

    return msgpack.packb([ts, [encode_event(e) for e in events], data_parallel_rank])


class KVEventPublisher:
    """A ZeroMQ PUB socket (and optional replay ROUTER socket) fed by a thread of its own, so a
    step never waits on the network; `publish` queues a step's events.

    Args:
      config: the options (`publisher` "zmq").
      data_parallel_rank: this engine's rank among data-parallel replicas (it offsets the ports,
        as vLLM does).
    """

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        try:
            import msgpack  # noqa: F401  (checked here, used by the thread)
            import zmq
        except ImportError as err:
            raise ImportError(
                f"kv_events_config needs pyzmq and msgpack ({err.name} is missing): pip install 'jaxpaged[server]'"
            ) from None
        self.config, self.rank = config, data_parallel_rank
        self._queue: queue.Queue[tuple[float, list[KVEvent]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self.endpoint = _offset_port(config.endpoint, data_parallel_rank)
        _bind_or_connect(self._pub, self.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(_offset_port(config.replay_endpoint, data_parallel_rank))
        self.num_batches = 0
        self._thread = threading.Thread(target=self._run, name="jaxpaged-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events published on %s (topic %r)", self.endpoint, config.topic)

    def publish(self, events: list[KVEvent]) -> None:
        """Queues one step's events as a batch (nothing for none)."""
        if events:
            self._queue.put((time.time(), events))

    def close(self) -> None:
        """Sends what is queued, then closes the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        topic = self.config.topic.encode()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            payload = encode_batch(events, ts, self.rank)
            seq = self.num_batches
            try:
                self._pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
            except Exception:  # the step must not die with the socket: log, keep the batch for replay
                logger.exception("KV event batch %d could not be sent", seq)
            self._buffer.append((seq, payload))
            self.num_batches += 1

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV event replay request of %d frames ignored (expected [identity, b'', seq])", len(frames))
            return
        client, _, start = frames
        topic = self.config.topic.encode()
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", topic, END_OF_REPLAY, b""))


def _offset_port(endpoint: str, rank: int) -> str:
    """vLLM's rule: data-parallel rank r publishes on port + r (inproc: a `_dp{r}` suffix)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


def _bind_or_connect(socket, endpoint: str) -> None:
    """vLLM's rule: a wildcard address (or ipc/inproc) binds; a host address connects to a
    subscriber that bound it."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)
