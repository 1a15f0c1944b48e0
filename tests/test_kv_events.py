"""KV cache events (vLLM's format): what the block manager and the host tier record, replayed by
a subscriber, is exactly what each tier holds; the options are checked by name; an engine
publishes them over ZeroMQ; vLLM's router follows them (`--policy kv_aware`)."""

import random

import pytest

from jaxpaged.config.kv_events import KVEventsConfig
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.disk_tier import DiskTier
from jaxpaged.core.host_tier import HostTier
from jaxpaged.core.kv_events import CPU, DISK, GPU, AllBlocksCleared, BlockStored, KVEventLog, external_hash
from jaxpaged.core.sequence import Sequence
from jaxpaged.engine.kv_event_publisher import encode_event
from jaxpaged.engine_args import EngineArgs, EngineArgsError

BS = 4


class Subscriber:
    """What a subscriber rebuilds from the events as they come over the wire (vLLM's tagged
    maps): per medium, the hashes held and each one's parent and tokens."""

    def __init__(self, block_size: int = BS):
        self.block_size = block_size
        self.held = {GPU: set(), CPU: set(), DISK: set()}
        self.blocks = {}  # hash -> (parent, tokens)

    def apply(self, events: list[dict]) -> None:
        bs = self.block_size
        for event in events:
            kind = event["type"]
            if kind == "AllBlocksCleared":
                self.held = {GPU: set(), CPU: set(), DISK: set()}
            elif kind == "BlockRemoved":
                assert set(event["block_hashes"]) <= self.held[event["medium"]], "removed a block never stored"
                self.held[event["medium"]] -= set(event["block_hashes"])
            else:
                assert kind == "BlockStored" and event["block_size"] == bs
                hashes, tokens, parent = event["block_hashes"], event["token_ids"], event["parent_block_hash"]
                assert len(tokens) == bs * len(hashes)
                assert parent is None or parent in self.blocks, "a store whose parent was never announced"
                for i, h in enumerate(hashes):
                    assert h not in self.held[event["medium"]], "stored twice"
                    self.held[event["medium"]].add(h)
                    self.blocks[h] = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
                    parent = h

    def take(self, log: KVEventLog) -> None:
        self.apply([encode_event(e) for e in log.take()])


def held_by(bm: BlockManager) -> dict[str, set[int]]:
    return {
        GPU: {external_hash(h) for h in bm.cached_block_hash_to_block},
        CPU: {external_hash(h) for h in bm.host_tier.cached},
        DISK: set(),
    }


def test_the_events_replayed_are_what_each_tier_holds():
    """Random prompts sharing prefixes through a small pool and host tier (evictions from both,
    host hits loaded back, resets): after every admission the subscriber's view equals the tiers',
    and each block's parent chain spells its sequence's tokens."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=13, block_size=BS, host_tier=HostTier(6), events=KVEventLog(BS))
    sub, running = Subscriber(), []
    prefixes = [[rng.randrange(50) for _ in range(BS * 3)] for _ in range(3)]
    for step in range(120):
        if running and (len(running) > 2 or rng.random() < 0.4):
            bm.deallocate(running.pop(rng.randrange(len(running))))
        tokens = rng.choice(prefixes)[: BS * rng.randint(0, 3)] + [rng.randrange(50) for _ in range(rng.randint(1, 9))]
        seq = Sequence(f"r{step}", tokens)
        if bm.can_allocate(seq):
            bm.allocate(seq)
            bm.may_append(seq, seq.num_uncomputed)
            seq.num_computed_tokens = seq.num_tokens
            bm.take_transfers()
            running.append(seq)
        if step % 50 == 49:
            bm.reset_prefix_cache()
        sub.take(bm.events)
        assert sub.held == held_by(bm), f"step {step}"
        for seq in running:
            for i, h in enumerate(seq.block_hashes[: len(seq.block_table)]):
                h = external_hash(h)
                if h in sub.held[GPU]:  # its chain back to the first block spells the tokens
                    chain = []
                    while h is not None:
                        h, tokens = sub.blocks[h]
                        chain[:0] = tokens
                    assert chain == seq.token_ids_slice(0, (i + 1) * BS)
    assert sub.held[CPU], "the host tier never held a block: the test did not evict"


def test_the_disk_tier_announces_the_files_it_writes_and_forgets(tmp_path):
    """Blocks announced on the device and written to disk are stored there (`DISK`, from the
    writer thread); the size cap's evictions and a rejected file remove them; a block the engine
    never announced (an earlier run's) is written silently."""
    import numpy as np

    memory = np.arange(4 * 8, dtype=np.float32).reshape(4, 8)
    file_bytes = DiskTier(str(tmp_path / "probe"), bytes(range(32)), 1 << 30, memory).file_bytes
    disk = DiskTier(str(tmp_path / "kv"), bytes(range(32)), 2 * file_bytes, memory)
    log = KVEventLog(BS)
    BlockManager(num_blocks=8, block_size=BS, host_tier=HostTier(4), disk_tier=disk, events=log)
    assert disk.events is log  # the block manager hands its log to the disk tier
    hashes = [bytes([i]) * 32 for i in range(1, 5)]
    parent = None
    for i, h in enumerate(hashes[:3]):  # three announced blocks; the fourth never was
        log.stored(h, parent, list(range(i * BS, (i + 1) * BS)), None, GPU)
        parent = h
    sub = Subscriber()
    sub.take(log)
    for slot, h in enumerate(hashes):
        disk.save(h, slot)
        disk.flush()
    sub.take(log)
    # written in order, at most two files: the first two were evicted, the fourth is not announced
    assert sub.held[DISK] == {external_hash(hashes[2])} and disk.num_files == 2
    with open(disk._files.path(hashes[2]), "r+b") as f:  # corrupt it: the read rejects it
        f.seek(-1, 2)
        f.write(b"\xff")
    assert not disk.read(hashes[2], 0)
    sub.take(log)
    assert sub.held[DISK] == set() and sub.held[GPU] == {external_hash(h) for h in hashes[:3]}
    disk.close()


def test_a_sequences_blocks_go_out_as_one_store_chained_to_its_cached_prefix():
    log = KVEventLog(BS)
    bm = BlockManager(num_blocks=16, block_size=BS, events=log)
    first = Sequence("a", list(range(10)))
    bm.allocate(first)
    bm.may_append(first, 10)
    (stored,) = log.take()
    assert stored == BlockStored(
        [external_hash(h) for h in first.block_hashes[:2]], None, list(range(8)), BS, None, GPU
    )
    second = Sequence("b", list(range(8)) + [7, 7, 7, 7, 9])
    second.lora_name = "sql"
    bm.allocate(second)  # its first two blocks are hits: not stored again
    bm.may_append(second, second.num_uncomputed)
    (stored,) = log.take()
    assert stored.parent_block_hash == external_hash(first.block_hashes[1])
    assert stored.token_ids == [7, 7, 7, 7] and stored.lora_name == "sql"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{not json", "is not JSON"),
        ({"enable_kv_cache_events": True, "endpoint": "5557"}, "must be a ZeroMQ address"),
        ({"enable_kv_cache_events": "yes"}, "must be true or false"),
        ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher='kafka' is not supported"),
        ({"enable_kv_cache_events": True, "hwm": 0}, "hwm=0 must be a positive integer"),
        ({"enable_kv_cache_event": True}, "unknown key(s) enable_kv_cache_event"),
    ],
)
def test_bad_options_are_refused_by_name(value, message):
    with pytest.raises(EngineArgsError, match="kv-events-config|kv_events_config") as err:
        EngineArgs(model="demo", kv_events_config=value)
    assert message in str(err.value)


def test_options_take_vllms_json_and_need_prefix_caching():
    args = EngineArgs(model="demo", kv_events_config='{"enable_kv_cache_events": true, "topic": "kv"}')
    assert args.kv_events_config == KVEventsConfig(True, "zmq", topic="kv") and args.kv_events_config.publishes
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).publishes
    with pytest.raises(EngineArgsError, match="needs `enable_prefix_caching` on"):
        EngineArgs(model="demo", enable_prefix_caching=False, kv_events_config={"enable_kv_cache_events": True})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receive(socket, timeout_ms: int = 5000) -> list[list[bytes]]:
    """Every message that arrives until none has for `timeout_ms`."""
    messages = []
    while socket.poll(timeout_ms):
        messages.append(socket.recv_multipart())
        timeout_ms = 500
    return messages


def test_an_engine_publishes_what_its_prefix_cache_holds_and_replays_it():
    """The demo engine with events on: prompts sharing a prefix; the batches that arrive on a SUB
    socket (vLLM's three frames, numbered from 0) rebuild the device's prefix cache exactly, and
    the replay socket sends them again, ending with -1."""
    import msgpack
    import zmq
    from shared_engines import CANONICAL

    from jaxpaged import LLM, SamplingParams

    port, replay_port = _free_port(), _free_port()
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": "kv@demo",
    }
    llm = LLM(**CANONICAL["demo"], kv_events_config=config)
    context = zmq.Context()
    try:
        sub = context.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@demo")
        engine = llm.llm_engine
        deadline = 50
        while not _receive(sub, 100) and deadline:  # PUB drops what it sends before SUB joins
            engine.kv_events.publish([AllBlocksCleared()])
            deadline -= 1
        _receive(sub, 300)
        start = engine.kv_events.num_batches
        prefix = (
            "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
            "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters."
        )
        suffixes = (" And God said, Let there be light", " And God saw the light", " And the evening and the morning")
        llm.generate([prefix + s for s in suffixes], SamplingParams(max_tokens=4))
        messages = _receive(sub)
        assert [m[0] for m in messages] == [b"kv@demo"] * len(messages)
        assert [int.from_bytes(m[1], "big") for m in messages] == list(range(start, start + len(messages)))
        sub_view = Subscriber(block_size=engine.config.cache.block_size)
        for _, _, payload in messages:
            ts, events, rank = msgpack.unpackb(payload)
            assert rank == 0 and isinstance(ts, float)
            sub_view.apply(events)
        held = {external_hash(h) for h in engine.scheduler.block_manager.cached_block_hash_to_block}
        assert sub_view.held[GPU] == held and len(held) >= 3, len(held)  # the shared prefix and the prompts
        replay = context.socket(zmq.DEALER)
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        replay.send_multipart([b"", start.to_bytes(8, "big")])
        replayed = _receive(replay)
        assert [m[1:] for m in replayed[:-1]] == messages  # the router's frames: topic, seq, payload
        assert replayed[-1] == [b"", b"kv@demo", (-1).to_bytes(8, "big", signed=True), b""]
    finally:
        context.destroy(linger=0)
        llm.llm_engine.shutdown()
