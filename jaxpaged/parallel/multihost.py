"""One engine over several machines: JAX's multi-controller runtime (`jax.distributed`).

Every process holds its devices' shards and runs the same compiled step programs; a step runs
only when all of them call it. Process 0, the leader, schedules, and before each device call it
broadcasts what to run (a fixed-size header and the step's packed int32 buffer) to the others,
the followers, which run `follow` until the leader says stop. Only the leader serves requests.
The broadcast is itself a small JAX collective (`multihost_utils.broadcast_one_to_all`), so no
transport beyond the one `jax.distributed` sets up is needed.

    leader   (node_rank 0): LLMEngine / jaxpaged serve       -> StepChannel.send before each call
    follower (node_rank k): jaxpaged serve --node-rank k     -> follow(runner, StepChannel())
"""

import hashlib
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

logger = logging.getLogger("jaxpaged")

# Commands of the step channel.
EXECUTE, SEED, STOP = 1, 2, 3
HEADER_SIZE = 6  # command, four integer fields, payload length


class SettingsMismatchError(ValueError):
    """The processes of one engine were started with different settings.

    Attributes:
      setting: the first setting that differs from process 0's (a name of `settings`).
      value: this process's value of it, as text.
      reason: which settings differ on which processes, and how to fix it.
    """

    def __init__(self, setting: str, value: str, reason: str):
        super().__init__(f"{setting}={value!r}: {reason}")
        self.setting, self.value, self.reason = setting, value, reason


def initialize(nnodes: int, node_rank: int, master_addr: str, master_port: int) -> None:
    """Joins the processes into one JAX runtime (before anything touches a device).

    On CPU the cross-process collectives go over gloo. A runtime already initialized (by the
    caller, or an earlier engine in this process) is kept.
    """
    if nnodes == 1 or jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices; GPUs use NCCL
    # JAX's preemption service would take SIGTERM for itself; `jaxpaged serve` drains on it.
    jax.config.update("jax_enable_preemption_service", False)
    logger.info("joining %d processes at %s:%d as process %d", nnodes, master_addr, master_port, node_rank)
    jax.distributed.initialize(f"{master_addr}:{master_port}", num_processes=nnodes, process_id=node_rank)


def is_leader() -> bool:
    return jax.process_index() == 0


class StepChannel:
    """The leader's commands to the followers, one header and one payload per command."""

    def send(self, command: int, fields: tuple[int, ...], payload: np.ndarray) -> None:
        """Leader: broadcasts a command with up to four integer fields and an int32 payload."""
        header = np.zeros(HEADER_SIZE, np.int32)
        header[0], header[1 : 1 + len(fields)], header[-1] = command, fields, payload.size
        multihost_utils.broadcast_one_to_all(header)
        if payload.size:
            multihost_utils.broadcast_one_to_all(np.ascontiguousarray(payload, np.int32))

    def receive(self) -> tuple[int, tuple[int, ...], np.ndarray]:
        """Follower: the next command, its four fields and its payload."""
        header = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(HEADER_SIZE, np.int32)))
        size = int(header[-1])
        payload = np.zeros(size, np.int32)
        if size:
            payload = np.asarray(multihost_utils.broadcast_one_to_all(payload))
        return int(header[0]), tuple(int(x) for x in header[1:-1]), payload


def agree_on_settings(settings: dict[str, str], seed: int) -> int:
    """Checks that every process was started with the same `settings` (see
    `EngineConfig.shared_settings`) and returns the leader's seed, which every process takes.

    Raises:
      SettingsMismatchError: on every process, naming each setting that differs from process 0's and
        the processes that differ (a mismatch would otherwise fail, or hang, at the first step).
    """
    if jax.process_count() == 1:
        return seed
    # int32 words: JAX (64-bit types off) would narrow int64 silently. The seed travels in two.
    names = sorted(settings)
    digests = np.array([_digest(settings[name]) for name in names], np.int32)
    header = np.array([len(names), _digest(",".join(names)), seed >> 31, seed & 0x7FFFFFFF], np.int32)
    headers = np.asarray(multihost_utils.process_allgather(header))  # [P, 4]
    if (headers[:, :2] != headers[0, :2]).any():
        raise RuntimeError(
            "the processes run different versions of jaxpaged (their engine settings differ in "
            "kind): install the same version on every machine"
        )
    everyone = np.asarray(multihost_utils.process_allgather(digests))  # [P, settings]
    differ = [(name, np.flatnonzero(everyone[:, i] != everyone[0, i])) for i, name in enumerate(names)]
    differ = [(name, ranks) for name, ranks in differ if ranks.size]
    if differ:
        name, _ = differ[0]
        listed = "; ".join(f"{n} on process(es) {', '.join(map(str, ranks))}" for n, ranks in differ)
        raise SettingsMismatchError(
            name,
            settings[name],
            "the processes of one engine must agree on every setting "
            f"but the per-process ones; different from process 0: {listed}. Start every "
            "process with the same flags and model (only --node-rank and local paths may "
            "differ)",
        )
    return (int(headers[0, 2]) << 31) | int(headers[0, 3])


def _digest(text: str) -> int:
    """31 bits of `text`'s SHA-256."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little") & 0x7FFFFFFF


def agree_on_blocks(num_blocks: int) -> int:
    """The pool size every process can hold (the smallest of their plans)."""
    if jax.process_count() == 1:
        return num_blocks
    return int(np.min(multihost_utils.process_allgather(np.array([num_blocks], np.int64))))


def follow(runner, channel: StepChannel) -> int:
    """Follower: runs the leader's commands on `runner` until it says stop; returns the number
    of steps run."""
    steps = 0
    while True:
        command, fields, payload = channel.receive()
        if command == STOP:
            logger.info("the leader stopped after %d steps", steps)
            return steps
        if command == EXECUTE:
            runner.follow_step(fields, payload)
            steps += 1
        elif command == SEED:
            slot, prompt_len, length = fields[:3]
            runner.seed_penalty_slot(slot, payload[:length].tolist(), prompt_len)
        else:
            raise RuntimeError(f"unknown step-channel command {command}")
