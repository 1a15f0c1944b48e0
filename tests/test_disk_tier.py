"""Disk tier of the KV cache: block files written atomically and read back bit for bit by a later
engine process; truncated, corrupt and foreign files detected, removed and recomputed, never used;
the size cap; and greedy tokens equal to transformers across processes."""

import gc
import json
import logging
import os
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest
from engine_fixtures import hf_greedy, make_model_dir

from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.disk_tier import DiskTier
from jaxpaged.core.host_tier import HostTier
from jaxpaged.core.sequence import Sequence

FINGERPRINT = bytes(range(32))
SLOT_SHAPE = (2, 3, 4, 2, 8)  # K/V, layers, block size, kv heads, head_dim


def memory(slots=6, seed=0):
    return np.random.default_rng(seed).standard_normal((slots, *SLOT_SHAPE)).astype(np.float32)


def h(i: int) -> bytes:
    return bytes([i]) * 32


def test_blocks_round_trip_through_files_a_later_tier_finds(tmp_path):
    mem = memory()
    disk = DiskTier(str(tmp_path), FINGERPRINT, 1 << 30, mem)
    for slot in range(3):
        disk.save(h(slot), slot)
    disk.flush()
    assert disk.write_bytes == 3 * mem[0].nbytes
    files = sorted(os.listdir(disk.directory))
    assert files == sorted(h(i).hex() + ".kv" for i in range(3))  # no temporaries left
    later = DiskTier(str(tmp_path), FINGERPRINT, 1 << 30, np.zeros_like(mem))
    assert later.num_files == 3 and later.contains(h(1)) and not later.contains(h(9))
    assert later.read(h(1), 4)
    np.testing.assert_array_equal(later.memory[4], mem[1])
    assert later.hits == 1 and later.read_bytes == mem[0].nbytes
    other = DiskTier(str(tmp_path), bytes(32), 1 << 30, np.zeros_like(mem))  # another model: another directory
    assert other.num_files == 0


def damage_truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 7)


def damage_flip(path):
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))


def damage_header(path):
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 32)  # another fingerprint


def damage_garbage(path):
    with open(path, "wb") as f:
        f.write(b"not a block")


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip, damage_header, damage_garbage])
def test_a_damaged_file_is_detected_removed_and_never_used(tmp_path, caplog, damage):
    mem = memory()
    disk = DiskTier(str(tmp_path), FINGERPRINT, 1 << 30, mem)
    disk.save(h(7), 0)
    disk.flush()
    damage(os.path.join(disk.directory, h(7).hex() + ".kv"))
    later = DiskTier(str(tmp_path), FINGERPRINT, 1 << 30, np.full_like(mem, 5.0))
    with caplog.at_level(logging.WARNING, logger="jaxpaged"):
        assert not later.read(h(7), 2)
    assert "ignored, removed, and its block computed again" in caplog.text
    np.testing.assert_array_equal(later.memory[2], 5.0)  # nothing of it reached host memory
    assert later.rejected == 1 and not later.contains(h(7)) and not os.listdir(later.directory)


def test_a_file_of_another_block_layout_is_rejected(tmp_path):
    disk = DiskTier(str(tmp_path), FINGERPRINT, 1 << 30, memory())
    disk.save(h(1), 0)
    disk.flush()
    bigger = np.zeros((2, 2, 3, 8, 2, 8), np.float32)  # block size 8: a different payload length
    assert not DiskTier(str(tmp_path), FINGERPRINT, 1 << 30, bigger).read(h(1), 0)


def test_the_size_cap_removes_least_recently_used_files_and_temporaries(tmp_path):
    mem = memory()
    file_bytes = DiskTier(str(tmp_path / "probe"), FINGERPRINT, 1 << 30, mem).file_bytes
    disk = DiskTier(str(tmp_path), FINGERPRINT, 3 * file_bytes, mem)
    for i in range(3):
        disk.save(h(i), i)
    disk.flush()
    assert disk.read(h(0), 5)  # h(0) used again: h(1) is now the least recently used
    for i in (3, 4):
        disk.save(h(i), i)
    disk.flush()
    assert sorted(f for f in os.listdir(disk.directory)) == sorted(h(i).hex() + ".kv" for i in (0, 3, 4))
    stale, fresh = (os.path.join(disk.directory, f"x.kv.{i}.2.tmp") for i in (1, 2))
    for path in (stale, fresh):
        open(path, "wb").close()
    os.utime(stale, (time.time() - 3600,) * 2)  # an interrupted write; `fresh` may be another process's
    again = DiskTier(str(tmp_path), FINGERPRINT, 3 * file_bytes, mem)
    assert again.num_files == 3 and not os.path.exists(stale) and os.path.exists(fresh)


def test_a_file_removed_behind_the_tiers_back_is_a_plain_miss(tmp_path, caplog):
    disk = DiskTier(str(tmp_path), FINGERPRINT, 1 << 30, memory())
    disk.save(h(1), 0)
    disk.flush()
    os.remove(os.path.join(disk.directory, h(1).hex() + ".kv"))  # the cap of another process sharing it
    with caplog.at_level(logging.WARNING, logger="jaxpaged"):
        assert disk.contains(h(1)) and not disk.read(h(1), 2)
    assert not disk.contains(h(1)) and disk.rejected == 0 and not caplog.text


def test_writes_are_queued_once_and_the_writer_ends_with_its_tier(tmp_path):
    disk = DiskTier(str(tmp_path), FINGERPRINT, 1 << 30, memory())
    for _ in range(3):
        disk.save(h(4), 1)  # queued once, whatever the writer has done by now
    disk.flush()
    assert disk.write_bytes == memory()[0].nbytes
    writer = disk._files._thread
    ref = weakref.ref(disk)
    del disk
    gc.collect()
    assert ref() is None  # the writer thread does not keep the tier (and its host memory) alive
    writer.join(5)
    assert not writer.is_alive()


def test_salted_blocks_are_found_on_disk_by_their_salt_alone(tmp_path):
    mem = memory(slots=8)
    disk = DiskTier(str(tmp_path), FINGERPRINT, 1 << 30, mem)
    tier = HostTier(8, write_through=True)
    bm = BlockManager(num_blocks=16, block_size=4, host_tier=tier, disk_tier=disk)
    alice = Sequence("a", list(range(13)), cache_salt="alice")
    bm.allocate(alice)
    bm.may_append(alice, 13)
    assert not bm.take_transfers()  # nothing to copy before the step
    stores = bm.take_stores()  # after it: its 3 full blocks, as the engine then writes them
    assert len(stores.offloads) == 3
    for _, slot in stores.offloads:
        disk.save(tier.hash_of(slot), slot)
    disk.flush()
    later = DiskTier(str(tmp_path), FINGERPRINT, 1 << 30, memory(slots=8, seed=1))
    for salt, hit in (("bob", 0), (None, 0), ("alice", 12)):
        fresh = BlockManager(num_blocks=16, block_size=4, host_tier=HostTier(8), disk_tier=later)
        seq = Sequence("x", list(range(13)), cache_salt=salt)
        fresh.promote_from_disk(seq)
        assert fresh.get_computed_blocks(seq).num_tokens == hit, salt


# ---- engines in separate processes --------------------------------------------------------

RUN = """
import json, sys
from jaxpaged import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
llm = LLM(cfg["model"], dtype=cfg["dtype"], max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
          kv_offloading_size=0.01, kv_cache_dir=cfg["dir"], skip_tokenizer_init=True)
outs = llm.generate([{"prompt_token_ids": p} for p in cfg["prompts"]],
                    SamplingParams(temperature=0, max_tokens=cfg["max_tokens"], ignore_eos=True), use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in outs], "stats": llm.get_stats()}))
"""


def run_engine(model, directory, prompts, max_tokens, dtype="float32"):
    cfg = json.dumps(dict(model=model, dir=directory, prompts=prompts, max_tokens=max_tokens, dtype=dtype))
    proc = subprocess.run([sys.executable, "-c", RUN, cfg], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_new_engine_process_reuses_prefixes_an_earlier_one_computed(tmp_path):
    model = str(tmp_path / "model")
    os.makedirs(model)
    hf = make_model_dir(model)
    rng = np.random.default_rng(0)
    shared = rng.integers(3, 512, size=45).tolist()
    prompts = [shared + rng.integers(3, 512, size=5 + i).tolist() for i in range(4)]
    references = [hf_greedy(hf, p, 6) for p in prompts]
    directory = str(tmp_path / "kv")
    first = run_engine(model, directory, prompts[:1], 6)
    assert first["tokens"] == references[:1] and first["stats"]["kv_disk_write_bytes"] > 0
    second = run_engine(model, directory, prompts, 6)  # a fresh process: its device and host tiers start empty
    assert second["tokens"] == references
    assert second["stats"]["kv_disk_hit_tokens"] >= 32  # the first 2 full blocks of the shared prefix
    assert second["stats"]["external_prefix_cache_hits"] >= 32
    [fp32] = os.listdir(directory)  # one fingerprint so far
    other = run_engine(model, directory, prompts[:1], 6, dtype="bfloat16")  # another dtype: never these files
    assert other["stats"]["kv_disk_hit_tokens"] == 0 and other["stats"]["kv_disk_rejected_files"] == 0
    # Every file of the float32 engine damaged: a new engine finds them, rejects them, and recomputes.
    assert len(os.listdir(directory)) == 2
    for name in os.listdir(os.path.join(directory, fp32)):
        damage_flip(os.path.join(directory, fp32, name))
    damaged = run_engine(model, directory, prompts, 6)
    assert damaged["tokens"] == references and damaged["stats"]["kv_disk_rejected_files"] >= 1
