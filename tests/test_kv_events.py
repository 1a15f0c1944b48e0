"""KV cache events (vLLM's format): what the block manager and the host tier record, replayed by
a subscriber, is exactly what each tier holds; the options are checked by name; an engine
publishes them over ZeroMQ; vLLM's router follows them (`--policy kv_aware`)."""

import random

import pytest

from jaxpaged.config.kv_events import KVEventsConfig
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.host_tier import HostTier
from jaxpaged.core.kv_events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventLog, external_hash
from jaxpaged.core.sequence import Sequence
from jaxpaged.engine_args import EngineArgs, EngineArgsError

BS = 4


class Subscriber:
    """What a subscriber rebuilds from the events: per medium, the hashes held and each one's
    parent and tokens (a store must name a parent the subscriber knows, as the router requires)."""

    def __init__(self):
        self.held = {GPU: set(), CPU: set()}
        self.blocks = {}  # hash -> (parent, tokens)

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, AllBlocksCleared):
                self.held = {GPU: set(), CPU: set()}
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.held[event.medium], "removed a block never stored"
                self.held[event.medium] -= set(event.block_hashes)
            else:
                assert isinstance(event, BlockStored) and event.block_size == BS
                assert len(event.token_ids) == BS * len(event.block_hashes)
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    assert h not in self.held[event.medium], "stored twice"
                    self.held[event.medium].add(h)
                    self.blocks[h] = (parent, tuple(event.token_ids[i * BS : (i + 1) * BS]))
                    parent = h


def held_by(bm: BlockManager) -> dict[str, set[int]]:
    return {
        GPU: {external_hash(h) for h in bm.cached_block_hash_to_block},
        CPU: {external_hash(h) for h in bm.host_tier.cached},
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
        sub.apply(bm.events.take())
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
