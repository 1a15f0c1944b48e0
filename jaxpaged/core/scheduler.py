"""Continuous-batching scheduler with chunked prefill and preemption (host only, no JAX here).

Each engine step:
  1. `schedule()` picks what runs: first one decode token for each running sequence in decode
     (with a proposer, speculative decoding, each then gets proposals to check from the budget
     and the free blocks the decodes left: see `jaxpaged.core.speculation`), then prefill
     chunks of running sequences that are still prefilling (including ones resumed after
     preemption; a chunk shrinks to the free blocks before anything is preempted), then waiting
     sequences in FCFS order (one whose grammar is still compiling is passed over, like vLLM's
     WAITING_FOR_FSM; its `constraint` is not `ready`); all under `max_num_seqs` running sequences and
     `max_num_batched_tokens` tokens per step. Blocks come from the `BlockManager`; when a
     running sequence cannot get one, the most recently admitted running sequence not yet
     scheduled this step is preempted: by recompute, its blocks are freed (they stay in the
     prefix cache while nobody needs them), `num_computed_tokens` drops to 0, and it goes back
     to the FRONT of the waiting queue; on resume it recomputes prompt + outputs so far and
     samples its next token. By swap (`preemption_mode`, with a host tier that has room), its
     computed blocks are copied to host memory first and copied back on resume, so it
     recomputes nothing. No waiting sequence is admitted in a step that preempted. A batch of
     decodes alone runs `num_scheduler_steps` fused decode steps when nobody waits and nobody
     streams (a stream gets each token as it is sampled, as vLLM's do).
     Scheduling counts the step's tokens as computed (`num_computed_tokens` advances now), so
     the next step can be scheduled before this one's results are back (async scheduling):
     the token a step samples is then the sequence's pending token, which the next step reads on
     the device. The `SchedulerOutput` carries everything the runner needs: the sequences'
     inputs, the host tier's copies to run first, the fused steps, the sequences whose runner
     slots are free again.
  2. The runner carries out the copies, then computes the step.
  3. `postprocess(output, sampled_token_ids)` appends the sampled token of every entry whose
     step reached its last token (or the accepted proposals and the token after them, or a
     fused window's tokens), checks token-id stop rules and frees finished sequences. String
     stops are the detokenizer's: the engine calls `finish_sequence`. A constrained sequence's
     `constraint` advances with every token appended; its grammar completing finishes it
     ("stop"). Constrained sequences never fuse decode steps. A constrained decode computes the
     tokens its constraint allows alone after its own token (`forced`, see `_add_forced`): the
     sequence gains them and the token(s) sampled after them. Its proposals (speculative
     decoding) follow them: the tokens its grammar forces next, then the proposer's, cut at the
     first its constraint rejects (see `jaxpaged.structured.constraint`); forced tokens are
     not proposals (they are never rejected, and the spec-decode counters leave them out).
Every `schedule` is followed by its `postprocess`, at most `pipeline_depth` other `schedule`s in
between (one without pipeline parallelism).
"""

import dataclasses
import itertools
import logging
import time
from collections import deque

from jaxpaged.config import defaults
from jaxpaged.config.checks import check_batch_limits, check_choice
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.disk_tier import DiskTier
from jaxpaged.core.host_tier import HostTier, KVTransfers
from jaxpaged.core.kv_events import KVEvent, KVEventLog
from jaxpaged.core.lora_slots import LoraSlots
from jaxpaged.core.sequence import Sequence, SequenceStatus
from jaxpaged.core.speculation import (
    NGRAM_LOOKBACK,
    DraftModelProposer,
    NgramProposer,
    is_constrained,
    speculation_allowed,
)
from jaxpaged.core.step_inputs import ScheduledSequence
from jaxpaged.sampling_params import RequestOutputKind

# What a preempted sequence loses: recompute frees its blocks, swap copies them to the host tier.
PREEMPTION_MODES = ("recompute", "swap")

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Scheduling limits (vLLM's names).

    Attributes:
      max_num_seqs: most sequences running at once (and so per step).
      max_num_batched_tokens: most tokens computed per step (prefill chunks plus decodes).
      max_model_len: longest sequence, prompt plus output.
      block_size: token slots per KV block.
      num_blocks: KV blocks in the pool, including the reserved null block 0.
      enable_prefix_caching: reuse cached full blocks of equal prefixes.
      num_host_blocks: blocks of the host tier (0: none); see host_tier.py.
      preemption_mode: "recompute", or "swap" (needs a host tier; a sequence it has no room
        for is recomputed).
      num_scheduler_steps: decode steps fused into one step when every scheduled sequence
        decodes and nobody waits (1: no fusing).
      pipeline_depth: micro-batches in flight at once (pipeline parallelism: the stages, P;
        1: none). A step's results come back P - 1 steps later, a sequence is in one micro-batch
        in flight at most, and a step decodes at most 1/P of the running sequences, so that P
        groups take turns and every stage has work.
      lora_slots: LoRA adapters in one batch (the device pool's slots, `LoraSlots`); 0: no LoRA.
      kv_events: record the prefix cache's events (`take_kv_events`; only when they are published).
    """

    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int = defaults.max_num_batched_tokens(defaults.MAX_NUM_SEQS)
    max_model_len: int
    block_size: int = defaults.BLOCK_SIZE
    num_blocks: int
    enable_prefix_caching: bool = defaults.ENABLE_PREFIX_CACHING
    num_host_blocks: int = 0
    preemption_mode: str = "recompute"
    num_scheduler_steps: int = defaults.NUM_SCHEDULER_STEPS
    pipeline_depth: int = 1
    lora_slots: int = 0
    kv_events: bool = False

    def __post_init__(self):
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "block_size",
            "num_scheduler_steps",
            "pipeline_depth",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {self.num_blocks}")
        check_batch_limits(self.max_num_seqs, self.max_num_batched_tokens)
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be at least 0, got {self.num_host_blocks}")
        check_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        if self.preemption_mode == "swap" and not self.num_host_blocks:
            raise ValueError("preemption_mode='swap' needs a host tier (num_host_blocks > 0)")


@dataclasses.dataclass
class SchedulerOutput:
    """What one step computes, in batch order, and what must happen before it.

    Attributes:
      scheduled: (sequence, number of tokens it computes this step).
      step_inputs: the matching `ScheduledSequence`s for the runner.
      samples: whether each sequence's last scheduled token yields a sampled token.
      preempted: sequences preempted while scheduling this step.
      num_batched_tokens: tokens computed this step.
      num_decode_seqs: leading entries that decode (one token of their own, plus any proposals);
        the rest are prefills.
      drafts: the proposals each entry checks after its token (speculative decoding; empty
        lists without it).
      forced: the tokens each entry computes after its own without sampling them (its
        constraint allows each alone: `SequenceConstraint.forced_run`); empty lists when none.
      drafting: entries a draft model proposes for after the step (their block tables cover k
        positions past the step's tokens); the runner's output carries the proposals.
      num_steps: fused decode steps (1: a single step).
      transfers: the host tier's copies to run before the step.
      stores: the host tier's write-through copies, to run after the step (see host_tier.py).
      released_seq_ids: sequences finished or preempted since the previous schedule (the
        runner frees their slots before this step takes any).
      failed: sequences this schedule finished with an error instead of admitting them (their
        grammar failed: `Sequence.error`); the engine reports them as it reports aborts.
      lora_loads: `(slot, adapter)` LoRA adapters to load into the device pool before the step.
    """

    scheduled: list[tuple[Sequence, int]]
    step_inputs: list[ScheduledSequence]
    samples: list[bool]
    preempted: list[Sequence]
    num_batched_tokens: int
    num_decode_seqs: int
    drafts: list[list[int]] = dataclasses.field(default_factory=list)
    forced: list[list[int]] = dataclasses.field(default_factory=list)
    drafting: list[bool] = dataclasses.field(default_factory=list)
    num_steps: int = 1
    transfers: KVTransfers = KVTransfers([], [])
    stores: KVTransfers = KVTransfers([], [])
    released_seq_ids: list[int] = dataclasses.field(default_factory=list)
    failed: list[Sequence] = dataclasses.field(default_factory=list)
    lora_loads: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.drafts))

    @property
    def num_forced_tokens(self) -> int:
        return sum(map(len, self.forced))

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_seqs - self.num_draft_tokens - self.num_forced_tokens

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Decides each step's batch; owns the waiting queue, the running list and the pool's blocks.

    Attributes:
      waiting: FCFS queue of sequences holding no blocks.
      running: admitted sequences, in admission order (the last is preempted first).
      block_manager: the pool's `BlockManager`.
      num_preemptions: preemptions so far.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        eos_token_id: int | list[int] | None = None,
        disk_tier: DiskTier | None = None,
        proposer: NgramProposer | DraftModelProposer | None = None,
    ):
        """Args:
        config: the limits.
        eos_token_id: the model's EOS id(s); generation stops there unless `ignore_eos`.
        disk_tier: prefix blocks of earlier runs on disk (needs a host tier: `num_host_blocks`).
        proposer: proposes tokens for decoding sequences to check (speculative decoding; a
          draft model's come from the runner's output of the step before, see
          `DraftModelProposer`).
        """
        self.proposer = proposer
        self.config = config
        tier = HostTier(config.num_host_blocks, write_through=disk_tier is not None) if config.num_host_blocks else None
        events = KVEventLog(config.block_size) if config.kv_events else None
        self.block_manager = BlockManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, tier, disk_tier, events
        )
        ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        self.eos_token_ids = frozenset(ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._released: list[int] = []  # seq_ids finished or preempted since the last schedule
        self.lora_slots = LoraSlots(config.lora_slots) if config.lora_slots else None

    # -- requests ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """Queues a new sequence.

        Raises:
          ValueError: for an empty prompt, or a request that could never fit `max_model_len`
            or the whole KV pool.
        """
        cfg, p, mt = self.config, seq.num_prompt_tokens, seq.sampling_params.max_tokens
        if seq.status is not SequenceStatus.WAITING or seq.block_table:
            raise ValueError(f"only new sequences can be added, got {seq}")
        if p == 0:
            raise ValueError(f"request {seq.request_id!r}: the prompt is empty; give at least one token")
        if seq.lora is not None and self.lora_slots is None:
            raise ValueError(
                f"request {seq.request_id!r} asks for LoRA adapter {seq.lora!r}; start the engine with enable_lora=True"
            )
        if mt is None and p >= cfg.max_model_len:
            raise ValueError(
                f"request {seq.request_id!r}: the prompt ({p} tokens) leaves no room to generate under "
                f"max_model_len ({cfg.max_model_len}); shorten the prompt or raise max_model_len"
            )
        if mt is not None and p + mt > cfg.max_model_len:
            raise ValueError(
                f"request {seq.request_id!r}: prompt ({p} tokens) + max_tokens ({mt}) = {p + mt} exceeds "
                f"max_model_len ({cfg.max_model_len}); shorten the prompt, lower max_tokens or raise max_model_len"
            )
        # The last sampled token is never fed back, so at most total - 1 tokens need K/V.
        longest = (cfg.max_model_len if mt is None else p + mt) - 1
        need = -(-longest // cfg.block_size)
        have = self.block_manager.num_total_blocks
        if need > have:
            raise ValueError(
                f"request {seq.request_id!r} needs {need} KV blocks of {cfg.block_size} tokens "
                f"({longest} tokens) but the whole pool has {have} (num_blocks={cfg.num_blocks} "
                f"including the null block); raise gpu_memory_utilization or kv_cache_memory_bytes, "
                f"or lower max_tokens / max_model_len"
            )
        self.waiting.append(seq)

    def abort(self, request_id: str | list[str]) -> list[Sequence]:
        """Aborts every unfinished sequence of the request(s), wherever it is; frees its blocks.

        Returns:
          the sequences aborted (empty for unknown or finished requests).
        """
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        victims = [s for s in itertools.chain(self.running, self.waiting) if s.request_id in ids]
        for seq in victims:
            self.finish_sequence(seq, SequenceStatus.FINISHED_ABORTED)
        return victims

    def finish_sequence(self, seq: Sequence, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        """Finishes `seq` (e.g. on a stop string), freeing its blocks; no-op if already finished."""
        if not status.is_finished:
            raise ValueError(f"status must be a finished status, got {status}")
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._give_back_lora(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status, seq.stop_reason, seq.finish_time = status, stop_reason, time.time()
        seq.constraint = None  # its matcher is released
        self._released.append(seq.seq_id)

    def stop_on_string(self, seq: Sequence, num_output_tokens: int, stop: str) -> None:
        """Finishes `seq` on a stop string ending at its `num_output_tokens`-th output token: later
        tokens (of the same step) are dropped, and the stop string wins over a length or EOS
        finish of the same step (as in vLLM)."""
        del seq.output_token_ids[num_output_tokens:]
        if seq.is_finished:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        else:
            self.finish_sequence(seq, SequenceStatus.FINISHED_STOPPED, stop)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def needs_last_tokens(self) -> bool:
        """Whether a running sequence's next token mask depends on the token it sampled last (a
        grammar): a multi-process engine reads each step's results before scheduling the next
        (a single process fills the masks after dispatching the model program instead)."""
        return any(seq.constraint is not None and seq.constraint.needs_last_token for seq in self.running)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self, propose: bool = True, in_flight: frozenset[int] = frozenset()) -> SchedulerOutput:
        """Picks this step's sequences and token counts and gives them blocks (see module doc);
        with a proposer, decoding sequences get proposals unless `propose` is False (and a draft
        model proposes after the step for the entries it marks `drafting`). Sequences in
        `in_flight` (seq_ids in a pipeline's micro-batches in flight) are neither scheduled nor
        preempted; with a `pipeline_depth` P > 1 at most ceil(running / P) sequences decode."""
        cfg, bm = self.config, self.block_manager
        decode_limit = -(-len(self.running) // cfg.pipeline_depth)
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        chosen: set[int] = set()  # seq_ids in `scheduled`
        preempted: list[Sequence] = []
        num_decode_seqs = 0
        drafts: dict[int, list[int]] = {}  # seq_id -> proposals it checks this step
        forced: dict[int, list[int]] = {}  # seq_id -> tokens it computes unsampled after its own
        admitted: set[int] = set()  # seq_ids admitted from the waiting queue this step
        failed: list[Sequence] = []  # finished with their grammar's error instead of admitted
        # 1. Decodes, then 2. prefill chunks of running sequences, both in admission order.
        for decode in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status is not SequenceStatus.RUNNING or seq.seq_id in chosen or self._ends_pending(seq):
                    continue  # preempted above, already scheduled, or its pending tokens end it
                if (seq.num_uncomputed == 1) != decode or seq.seq_id in in_flight:
                    continue
                if decode and len(scheduled) == decode_limit:
                    break  # the rest decode in the next micro-batches
                n = min(seq.num_uncomputed, budget)
                if not decode:  # shrink the chunk to the free blocks rather than preempt
                    room = (len(seq.block_table) + bm.num_free_blocks) * cfg.block_size - seq.num_computed_tokens
                    n = max(1, min(n, room))
                if self._make_room(seq, n, chosen, in_flight, preempted):
                    bm.may_append(seq, n)
                    scheduled.append((seq, n))
                    chosen.add(seq.seq_id)
                    budget -= n
            if decode:
                num_decode_seqs = len(scheduled)
                budget = self._add_forced(scheduled, forced, budget)
                budget = self._add_proposals(scheduled, forced, drafts, budget) if propose else budget

        # 3. Waiting sequences, FCFS; the queue's head blocks the rest (also while it waits for
        # a pending token: it was preempted with a step in flight).
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not preempted:
            seq = next((s for s in self.waiting if self._admissible(s)), None)
            if seq is None or seq.num_pending_tokens:
                break
            if seq.constraint is not None and seq.constraint.error is not None:
                seq.error = seq.constraint.error
                self.finish_sequence(seq, SequenceStatus.FINISHED_ABORTED)
                logger.info("request %s: %s", seq.request_id, seq.error)
                failed.append(seq)
                continue
            parent = self._fork_parent(seq)
            if parent is None:
                bm.promote_from_disk(seq)
            cached = bm.get_computed_blocks(seq, parent).num_tokens
            n = min(seq.num_tokens - cached, budget)
            if not bm.can_allocate(seq, n, parent):
                break
            self.waiting.remove(seq)
            if seq.lora is not None:
                seq.lora_slot = self.lora_slots.take(seq.lora)
            bm.allocate(seq, parent)
            bm.may_append(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            admitted.add(seq.seq_id)
            budget -= n

        drafting_step = propose and isinstance(self.proposer, DraftModelProposer)
        num_steps = 1 if drafting_step else self._fused_steps(scheduled, num_decode_seqs, drafts)
        inputs, samples, entry_drafts, entry_forced, drafting = [], [], [], [], []
        for seq, n in scheduled:
            entry_drafts.append(drafts.get(seq.seq_id, []))
            entry_forced.append(forced.get(seq.seq_id, []))
            inp = self._step_input(seq, n, entry_drafts[-1], entry_forced[-1], num_steps, seq.seq_id in admitted)
            inputs.append(inp)
            samples.append(inp.samples)
            # the step's tokens count as computed from now on; what it samples is pending
            seq.num_computed_tokens += inp.live_steps if num_steps > 1 else n
            if inp.samples:
                gained = 1 + len(entry_drafts[-1]) + len(entry_forced[-1])
                seq.num_pending_tokens += inp.live_steps if num_steps > 1 else gained
            drafting.append(drafting_step and inp.samples and self._reserve_draft_room(seq))
        released, self._released = self._released, []
        return SchedulerOutput(
            scheduled=scheduled,
            step_inputs=inputs,
            samples=samples,
            preempted=preempted,
            num_batched_tokens=cfg.max_num_batched_tokens - budget,
            num_decode_seqs=num_decode_seqs,
            drafts=entry_drafts,
            forced=entry_forced if forced else [],
            drafting=drafting,
            num_steps=num_steps,
            transfers=bm.take_transfers(),
            stores=bm.take_stores(),
            released_seq_ids=released,
            failed=failed,
            lora_loads=self.lora_slots.take_loads() if self.lora_slots is not None else [],
        )

    def _admissible(self, seq: Sequence) -> bool:
        """Whether a waiting sequence may start now: its grammar compiled, its LoRA adapter given
        a slot (the batch holds at most `max_loras` adapters)."""
        ready = seq.constraint is None or seq.constraint.ready
        return ready and (seq.lora is None or self.lora_slots.can_take(seq.lora))

    def copies_done(self, output: SchedulerOutput) -> None:
        """Called once `output`'s host-tier copies have run (the step dispatched): with a disk
        tier, queues the blocks they brought into host slots under a prefix hash for writing."""
        bm = self.block_manager
        if bm.disk_tier is None:
            return
        for transfers in (output.transfers, output.stores):
            for _, slot in transfers.offloads:
                block_hash = bm.host_tier.hash_of(slot)
                if block_hash is not None:  # a swapped-out sequence's slots have none
                    bm.disk_tier.save(block_hash, slot)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix (`BlockManager.reset_prefix_cache`: after new weights)."""
        self.block_manager.reset_prefix_cache()

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's events since the last call (none unless `kv_events`)."""
        events = self.block_manager.events
        return [] if events is None else events.take()

    @property
    def kv_usage(self) -> float:
        """The fraction of the pool's blocks in use."""
        return self.block_manager.usage

    def stats(self, block_bytes: int) -> dict[str, float | int]:
        """The scheduler's gauges and counters and the KV cache's, under vLLM's names (the host
        tier's and the disk tier's too, where there are those); `block_bytes`: one block's bytes
        on the device."""
        bm, tier, disk = self.block_manager, self.block_manager.host_tier, self.block_manager.disk_tier
        stats = {
            "num_preemptions": self.num_preemptions,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "gpu_cache_usage_perc": bm.usage,
            "num_total_blocks": bm.num_total_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_cached_tokens": len(bm.cached_block_hash_to_block) * bm.block_size,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
        }
        if tier is not None:  # prefix hits there under vLLM's names for an external KV cache
            stats |= {
                "external_prefix_cache_queries": tier.queries,
                "external_prefix_cache_hits": tier.hits,
                "kv_host_tier_blocks": tier.num_slots,
                "kv_host_tier_cached_blocks": len(tier.cached),
                "kv_host_tier_swapped_blocks": tier.num_swapped,
                "kv_offload_bytes": tier.offloaded_blocks * block_bytes,
                "kv_load_bytes": tier.loaded_blocks * block_bytes,
                "kv_swapped_out_blocks": tier.swapped_out_blocks,
                "kv_swapped_in_blocks": tier.swapped_in_blocks,
            }
        if tier is not None and disk is not None:
            stats |= {
                "kv_disk_hit_tokens": disk.hits * bm.block_size,
                "kv_disk_read_bytes": disk.read_bytes,
                "kv_disk_write_bytes": disk.write_bytes,
                "kv_disk_blocks": disk.num_files,
                "kv_disk_rejected_files": disk.rejected,
                "kv_disk_dropped_writes": disk.dropped_writes,
            }
        return stats

    def _step_input(
        self, seq: Sequence, n: int, proposal: list[int], forced: list[int], num_steps: int, admitted: bool
    ) -> ScheduledSequence:
        """The runner's view of `seq` computing `n` tokens (its own, then `forced`, then
        `proposal`) this step."""
        c, own = seq.num_computed_tokens, n - len(proposal) - len(forced)
        known = seq.token_ids_slice(c, min(c + own, seq.num_tokens))
        from_last = len(known) < own  # its token is still pending: the device reads it
        if from_last and (own != 1 or proposal):
            raise RuntimeError(f"{seq} would compute {own - len(known)} pending tokens; only a decode reads one")
        sp = seq.sampling_params
        live = self._live_steps(seq, num_steps) if num_steps > 1 else 1
        prefix = None
        if admitted and c and _has_penalties(sp):
            prefix = seq.token_ids_slice(0, c)
        targets = None
        if seq.needs_prompt_logprobs and c + 1 < seq.num_prompt_tokens:
            targets = seq.token_ids_slice(c + 1, min(c + own + 1, seq.num_prompt_tokens))
        return ScheduledSequence(
            token_ids=(known or [0]) + forced + proposal,
            num_computed=c,
            block_table=seq.block_table,
            seq_id=seq.seq_id,
            from_last=from_last,
            samples=c + own == seq.num_tokens + seq.num_pending_tokens,
            live_steps=live,
            params=sp,
            index=seq.index,
            prompt_len=seq.num_prompt_tokens,
            admitted=admitted,
            prefix_token_ids=prefix,
            prompt_targets=targets,
            constraint=seq.constraint,
            num_forced=len(forced),
            lora_slot=seq.lora_slot,
        )

    def _live_steps(self, seq: Sequence, num_steps: int) -> int:
        """Of `num_steps` fused decode steps, those before `seq` reaches max_tokens or max_model_len."""
        total = seq.num_tokens + seq.num_pending_tokens
        live = min(num_steps, self.config.max_model_len - total)
        mt = seq.sampling_params.max_tokens
        if mt is not None:
            live = min(live, mt - seq.num_output_tokens - seq.num_pending_tokens)
        return live

    def _ends_pending(self, seq: Sequence) -> bool:
        """Whether the tokens `seq` has pending take it to max_tokens or max_model_len (its last
        step is in flight: there is nothing more to compute for it)."""
        if not seq.num_pending_tokens:
            return False
        mt = seq.sampling_params.max_tokens
        total = seq.num_tokens + seq.num_pending_tokens
        return total >= self.config.max_model_len or (
            mt is not None and seq.num_output_tokens + seq.num_pending_tokens >= mt
        )

    def _fused_steps(self, scheduled: list[tuple[Sequence, int]], num_decode_seqs: int, drafts: dict) -> int:
        """How many decode steps this step fuses (1: none), with their blocks reserved.

        Fused when `num_scheduler_steps` > 1, every scheduled sequence decodes without proposals,
        nobody waits to be admitted, no sequence streams (its client would get the window's tokens
        in one chunk: inter-token latency k times the step time), no sequence needs the sampler's
        filtering or top logprobs (the fused program samples without them) and the pool has the
        blocks. A sequence that
        reaches max_tokens or max_model_len inside the window takes part for its own steps only.
        """
        k = self.config.num_scheduler_steps
        if k == 1 or not scheduled or num_decode_seqs != len(scheduled) or drafts or self.waiting:
            return 1
        if any(not fusable(seq.sampling_params) or streams(seq.sampling_params) for seq, _ in scheduled):
            return 1
        bs, need, live = self.config.block_size, 0, []
        for seq, _ in scheduled:
            steps = self._live_steps(seq, k)
            live.append(steps)
            need += max(0, -(-(seq.num_computed_tokens + steps) // bs) - len(seq.block_table))
        if need > self.block_manager.num_free_blocks or max(live) < 2:
            return 1
        for (seq, _), steps in zip(scheduled, live):
            self.block_manager.may_append(seq, steps)
        return k

    def _add_proposals(
        self,
        scheduled: list[tuple[Sequence, int]],
        forced: dict[int, list[int]],
        drafts: dict[int, list[int]],
        budget: int,
    ) -> int:
        """Gives the decoding entries of `scheduled` proposals to check after their `forced` runs,
        in order, from what the decodes and forced runs left: the token budget and the free
        blocks (never a cached block, never preempting anyone). Returns the budget left."""
        if self.proposer is None:
            return budget
        for i, (seq, _) in enumerate(scheduled):
            proposal = self._propose(seq, budget, forced.get(seq.seq_id, []))
            if self._extend(scheduled, i, proposal, drafts):
                budget -= len(proposal)
        return budget

    def _extend(
        self, scheduled: list[tuple[Sequence, int]], i: int, tokens: list[int], into: dict[int, list[int]]
    ) -> bool:
        """Entry i of `scheduled` computes `tokens` more (kept in `into` by seq_id) if the free
        blocks hold them (never a cached block, never preempting); whether it does."""
        seq, n = scheduled[i]
        if not tokens or not self.block_manager.can_append_from_free(seq, n + len(tokens)):
            return False
        self.block_manager.may_append(seq, n + len(tokens))
        scheduled[i] = (seq, n + len(tokens))
        into[seq.seq_id] = tokens
        return True

    def _add_forced(self, scheduled: list[tuple[Sequence, int]], forced: dict[int, list[int]], budget: int) -> int:
        """Gives the constrained decoding entries of `scheduled` the tokens their constraint allows
        alone next (`SequenceConstraint.forced_run`), to compute after their own token without
        sampling them, from what the decodes left: the token budget and the free blocks (never a
        cached block, never preempting anyone); their proposals, if any, come after them. Plain
        decoding would spend a step on each and sample exactly it (so outputs are the same, token
        for token); not for requests that want logprobs (an unsampled token has none), nor before
        `min_tokens`.

        A sequence whose one pending token (the step in flight samples it) is the first of its run
        gets the rest: that step samples under the mask of the constraint as it is now, which
        allows that token alone (with async scheduling a run costs two steps, not one per token).
        Returns the budget left."""
        for i, (seq, _) in enumerate(scheduled):
            c, pending, sp = seq.constraint, seq.num_pending_tokens, seq.sampling_params
            if c is None or pending > 1 or sp.logprobs is not None:
                continue
            if seq.num_output_tokens + pending < sp.min_tokens:
                continue
            # the sequence gains the run and one sampled token
            room = self.config.max_model_len - seq.num_tokens - pending - 1
            if sp.max_tokens is not None:
                room = min(room, sp.max_tokens - seq.num_output_tokens - pending - 1)
            limit = min(room, budget)
            if limit <= 0:
                continue
            run = c.forced_run(limit + pending)[pending:]
            if self._extend(scheduled, i, run, forced):
                budget -= len(run)
        return budget

    def _reserve_draft_room(self, seq: Sequence) -> bool:
        """Gives a sequence that samples this step blocks for the k positions past its computed
        tokens, from the free blocks alone (never preempting, never evicting): the draft model's
        proposing decode writes its K/V there after the step (its proposals' own, and those of
        the step's tokens it follows). False (no draft proposals for it) without them, or when
        it may not speculate."""
        k = self.proposer.k
        if seq.constraint is not None:  # the draft samples without its mask (see `_propose`)
            return False
        if not speculation_allowed(seq.sampling_params, seq.num_output_tokens + seq.num_pending_tokens):
            return False
        if seq.num_computed_tokens + k > self.config.max_model_len or not self.block_manager.can_append_from_free(
            seq, k
        ):
            return False
        self.block_manager.may_append(seq, k)
        return True

    def _propose(self, seq: Sequence, budget: int, run: list[int]) -> list[int]:
        """Proposals for a decoding sequence after its forced `run` (`_add_forced`): none for
        sequences that may not speculate, and none past `budget` tokens, max_tokens or
        max_model_len (the sequence gains at most run + proposals + 1 tokens)."""
        sp = seq.sampling_params
        if seq.num_pending_tokens or not speculation_allowed(sp, seq.num_output_tokens):
            return []  # proposals follow the sequence's tokens: all must be on the host
        room = self.config.max_model_len - seq.num_tokens - len(run) - 1
        if sp.max_tokens is not None:
            room = min(room, sp.max_tokens - seq.num_output_tokens - len(run) - 1)
        limit = min(room, budget, self.proposer.k)
        c = seq.constraint
        if c is None:
            if self.proposer.needs_model:  # the draft's, from the previous step's output
                return seq.spec_token_ids[: max(0, limit)]
            start = max(0, seq.num_tokens - NGRAM_LOOKBACK)
            return self.proposer.propose(seq.token_ids_slice(start, seq.num_tokens), limit)
        # A constrained sequence: the tokens its grammar forces after the run (its forced tokens
        # that the mask does not allow alone), then (n-gram) those that followed them before, cut
        # where the constraint rejects one (a draft proposes without the mask). The run is a
        # prefix of the forced tokens: both come from the constraint as it is now.
        proposal = c.forced_tokens(len(run) + limit)[len(run) :]
        if not self.proposer.needs_model and len(proposal) < limit:
            start = max(0, seq.num_tokens - NGRAM_LOOKBACK)
            tokens = seq.token_ids_slice(start, seq.num_tokens) + run + proposal
            proposal += self.proposer.propose(tokens, limit - len(proposal))
        return proposal[: c.valid_prefix(run + proposal) - len(run)] if proposal else []

    def postprocess(
        self,
        output: SchedulerOutput,
        sampled_token_ids: list[int] | list[list[int]] | dict[int, int],
        proposals: dict[int, list[int]] | None = None,
    ) -> list[tuple[int, Sequence, int]]:
        """Takes a computed step's sampled tokens (and a draft model's proposals) back.

        Args:
          output: what `schedule()` returned for the step.
          sampled_token_ids: one token per scheduled entry, in batch order (entries whose
            `samples` is False are ignored); or a list per entry: its accepted proposals and the
            token sampled after them, or a fused window's tokens (its `live_steps` of them); or a
            dict seq_id -> token for the sampling entries. Python ints (use `.tolist()` on arrays).
            An entry's `forced` tokens come before them (the step computed them unsampled).
          proposals: a draft model's tokens after each sequence's new ones, by seq_id (the
            runner's output of a step with `drafting` entries); every sequence tokens are
            appended to gets its own as `spec_token_ids`, or none.

        Returns:
          `(batch index, sequence, number of tokens appended)` of every sequence tokens were
          appended to (the last that many of its `output_token_ids`). Those that finished on a
          token-id rule (EOS, stop_token_ids, max_tokens, max_model_len) are `is_finished`,
          their blocks already freed; a sequence finished or aborted while its step was in
          flight gets nothing (its tokens are surplus).
        """
        now = time.time()
        appended = []
        drafts = output.drafts or [[]] * output.num_seqs
        forced = output.forced or [[]] * output.num_seqs
        drafting = output.drafting or [False] * output.num_seqs
        proposals = proposals or {}
        for i, ((seq, n), inp, proposal) in enumerate(zip(output.scheduled, output.step_inputs, drafts)):
            if not inp.samples:
                continue
            seq.num_pending_tokens -= inp.live_steps if output.num_steps > 1 else 1 + len(proposal) + len(forced[i])
            if seq.is_finished:
                continue  # aborted or finished while the step was in flight: its tokens are surplus
            tokens = sampled_token_ids[seq.seq_id] if isinstance(sampled_token_ids, dict) else sampled_token_ids[i]
            tokens = tokens if isinstance(tokens, list) else [tokens]
            seq.spec_token_ids = proposals.get(seq.seq_id, [])
            if proposal and seq.status is SequenceStatus.RUNNING:  # K/V is right up to the last accepted proposal
                seq.num_computed_tokens -= len(proposal) - (len(tokens) - 1)
            tokens = forced[i] + tokens
            if seq.first_token_time is None:
                seq.first_token_time = now
            count = 0
            for token in tokens:
                seq.output_token_ids.append(int(token))
                count += 1
                if seq.constraint is not None:
                    seq.constraint.accept(int(token))
                stop = self._check_stop(seq)
                if stop is not None:
                    self.finish_sequence(seq, *stop)
                    break
            appended.append((i, seq, count))
            if (proposal or drafting[i]) and not seq.is_finished and seq.status is SequenceStatus.RUNNING:
                self.block_manager.trim(seq)  # blocks that held only rejected proposals or the draft's room
        return appended

    # -- stats ------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- internals --------------------------------------------------------------------------

    def _make_room(
        self, seq: Sequence, n: int, chosen: set[int], in_flight: frozenset[int], preempted: list[Sequence]
    ) -> bool:
        """Preempts from the tail (never a sequence in `chosen` or `in_flight`) until `seq` can
        take `n` more tokens; False if `seq` itself had to go."""
        while not self.block_manager.can_append(seq, n):
            victim = next(s for s in reversed(self.running) if s.seq_id not in chosen and s.seq_id not in in_flight)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._give_back_lora(seq)
        self._released.append(seq.seq_id)
        if not (self.config.preemption_mode == "swap" and self.block_manager.swap_out(seq)):
            self.block_manager.deallocate(seq)  # by recompute
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _give_back_lora(self, seq: Sequence) -> None:
        if self.lora_slots is not None:
            self.lora_slots.give_back(seq.lora_slot)
        seq.lora_slot = 0

    def _fork_parent(self, seq: Sequence) -> Sequence | None:
        """With prefix caching off, the running sibling whose computed prompt blocks `seq` can share."""
        if self.config.enable_prefix_caching:
            return None  # siblings already share through the prefix cache
        siblings = [s for s in self.running if s.request_id == seq.request_id]
        return max(siblings, key=lambda s: s.num_computed_tokens, default=None)

    def _check_stop(self, seq: Sequence) -> tuple[SequenceStatus, int | None] | None:
        sp, token = seq.sampling_params, seq.last_token_id
        if seq.constraint is not None and seq.constraint.failure is not None:  # the grammar gave up
            seq.error = seq.constraint.failure
            return SequenceStatus.FINISHED_ABORTED, None
        if seq.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED, None
            if token in sp.stop_token_id_set:
                return SequenceStatus.FINISHED_STOPPED, token
        if seq.constraint is not None and seq.constraint.is_stopped:  # the grammar is complete
            return SequenceStatus.FINISHED_STOPPED, None
        if seq.num_tokens >= self.config.max_model_len or (
            sp.max_tokens is not None and seq.num_output_tokens >= sp.max_tokens
        ):
            return SequenceStatus.FINISHED_LENGTH, None
        return None


def _has_penalties(sp) -> bool:
    return sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1


def streams(sp) -> bool:
    """Whether a sequence's outputs go out as they come (`RequestOutputKind.DELTA`: a stream)."""
    return sp.output_kind is RequestOutputKind.DELTA


def fusable(sp) -> bool:
    """Whether a sequence's sampling runs in fused decode steps, which sample without top-k /
    top-p filtering, top logprobs and token masks (see `jaxpaged.model.sampler.SamplerOptions`)."""
    return not sp.logprobs and sp.top_k <= 0 and sp.top_p >= 1 and not is_constrained(sp)
