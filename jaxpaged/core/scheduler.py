"""Continuous-batching scheduler with chunked prefill and preemption (host only, no JAX here).

Each engine step:
  1. `schedule()` picks what runs: first one decode token for each running sequence in decode
     (with a proposer, speculative decoding, each then gets proposals to check from the budget
     and the free blocks the decodes left: see `jaxpaged.core.speculation`), then prefill chunks of running sequences that are still prefilling (including ones resumed
     after preemption; a chunk shrinks to the free blocks before anything is preempted), then
     waiting sequences in FCFS order; all under `max_num_seqs` running sequences and
     `max_num_batched_tokens` tokens per step. Blocks come from the
     `BlockManager`; when a running sequence cannot get one, the most recently admitted running
     sequence not yet scheduled this step is preempted: by recompute, its blocks are freed (they
     stay in the prefix cache while nobody needs them), `num_computed_tokens` drops to 0, and it
     goes back to the FRONT of the waiting queue; on resume it recomputes prompt + outputs so
     far and samples its next token. By swap (`preemption_mode`, with a host tier that has
     room), its computed blocks are copied to host memory first and copied back on resume,
     so it recomputes nothing. No waiting sequence is admitted in a step that preempted.
  2. The runner carries out the device<->host copies the block manager planned
     (`block_manager.take_transfers()`), then computes the step
     (`SchedulerOutput.step_inputs` -> `pack_step`).
  3. `postprocess(output, sampled_token_ids)` advances `num_computed_tokens`, appends the
     sampled token (or the accepted proposals and the token after them) of every sequence whose
     step reached its last token (a prefill chunk short
     of the end of the prompt samples nothing), checks token-id stop rules and frees finished
     sequences. String stops are the detokenizer's: the engine calls `finish_sequence`.
Call `schedule` and `postprocess` alternately, once each per step.
"""

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable

from jaxpaged.config.engine_args import PREEMPTION_MODES
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.disk_tier import DiskTier
from jaxpaged.core.host_tier import HostTier
from jaxpaged.core.sequence import Sequence, SequenceStatus
from jaxpaged.core.speculation import NGRAM_LOOKBACK, DraftModelSlots, NgramProposer, speculation_allowed
from jaxpaged.core.step_inputs import ScheduledSequence


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Scheduling limits (vLLM's names).

    Attributes:
      max_num_seqs: most sequences running at once (and so per step).
      max_num_batched_tokens: most tokens computed per step (prefill chunks plus decodes);
        the engine picks the default.
      max_model_len: longest sequence, prompt plus output.
      block_size: token slots per KV block.
      num_blocks: KV blocks in the pool, including the reserved null block 0.
      enable_prefix_caching: reuse cached full blocks of equal prefixes.
      num_host_blocks: blocks of the host tier (0: none); see host_tier.py.
      preemption_mode: "recompute", or "swap" (needs a host tier; a sequence it has no room
        for is recomputed).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int
    block_size: int = 16
    num_blocks: int
    enable_prefix_caching: bool = True
    num_host_blocks: int = 0
    preemption_mode: str = "recompute"

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is reserved), got {self.num_blocks}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_num_seqs ({self.max_num_seqs}); raise it or lower max_num_seqs"
            )
        if self.num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be at least 0, got {self.num_host_blocks}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.preemption_mode == "swap" and not self.num_host_blocks:
            raise ValueError("preemption_mode='swap' needs a host tier (num_host_blocks > 0)")


@dataclasses.dataclass
class SchedulerOutput:
    """What one step computes, in batch order.

    Attributes:
      scheduled: (sequence, number of tokens it computes this step).
      step_inputs: the matching `ScheduledSequence`s for `pack_step`.
      samples: whether each sequence's last scheduled token yields a sampled token.
      preempted: sequences preempted while scheduling this step.
      num_batched_tokens: tokens computed this step.
      num_decode_seqs: leading entries that decode (one token of their own, plus any proposals);
        the rest are prefills.
      drafts: the proposals each entry checks after its token (speculative decoding; empty
        lists without it).
    """

    scheduled: list[tuple[Sequence, int]]
    step_inputs: list[ScheduledSequence]
    samples: list[bool]
    preempted: list[Sequence]
    num_batched_tokens: int
    num_decode_seqs: int
    drafts: list[list[int]] = dataclasses.field(default_factory=list)

    @property
    def num_draft_tokens(self) -> int:
        return sum(map(len, self.drafts))

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_seqs - self.num_draft_tokens

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

    def __init__(self, config: SchedulerConfig, eos_token_id: int | list[int] | None = None,
                 disk_tier: DiskTier | None = None, proposer: NgramProposer | DraftModelSlots | None = None):  # fmt: skip
        """Args:
        config: the limits.
        eos_token_id: the model's EOS id(s); generation stops there unless `ignore_eos`.
        disk_tier: prefix blocks of earlier runs on disk (needs a host tier: `num_host_blocks`).
        proposer: proposes tokens for decoding sequences to check (speculative decoding; a
          draft model's are placeholders the engine fills before the step).
        """
        self.proposer = proposer
        self.config = config
        tier = HostTier(config.num_host_blocks, write_through=disk_tier is not None) if config.num_host_blocks else None
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching, tier,
                                          disk_tier)  # fmt: skip
        ids = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id
        self.eos_token_ids = frozenset(ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status, seq.stop_reason, seq.finish_time = status, stop_reason, time.time()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Picks this step's sequences and token counts and gives them blocks (see module doc)."""
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        chosen: set[int] = set()  # seq_ids in `scheduled`
        preempted: list[Sequence] = []
        num_decode_seqs = 0
        drafts: dict[int, list[int]] = {}  # seq_id -> proposals it checks this step
        # 1. Decodes, then 2. prefill chunks of running sequences, both in admission order.
        for decode in (True, False):
            for seq in list(self.running):
                if budget == 0:
                    break
                if seq.status is not SequenceStatus.RUNNING or seq.seq_id in chosen:
                    continue  # preempted above, or already scheduled
                if (seq.num_uncomputed == 1) != decode:
                    continue
                n = min(seq.num_uncomputed, budget)
                if not decode:  # shrink the chunk to the free blocks rather than preempt
                    room = (len(seq.block_table) + bm.num_free_blocks) * cfg.block_size - seq.num_computed_tokens
                    n = max(1, min(n, room))
                if self._make_room(seq, n, chosen, preempted):
                    bm.may_append(seq, n)
                    scheduled.append((seq, n))
                    chosen.add(seq.seq_id)
                    budget -= n
            if decode:
                num_decode_seqs = len(scheduled)
                budget = self._add_proposals(scheduled, drafts, budget)

        # 3. Waiting sequences, FCFS; the queue's head blocks the rest.
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not preempted:
            seq = self.waiting[0]
            parent = self._fork_parent(seq)
            if parent is None:
                bm.promote_from_disk(seq)
            cached = bm.get_computed_blocks(seq, parent).num_tokens
            n = min(seq.num_tokens - cached, budget)
            if not bm.can_allocate(seq, n, parent):
                break
            self.waiting.popleft()
            bm.allocate(seq, parent)
            bm.may_append(seq, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n

        inputs, samples, entry_drafts = [], [], []
        for seq, n in scheduled:
            c, proposal = seq.num_computed_tokens, drafts.get(seq.seq_id, [])
            own = n - len(proposal)
            inputs.append(ScheduledSequence(seq.token_ids_slice(c, c + own) + proposal, c, seq.block_table))
            samples.append(c + own == seq.num_tokens)
            entry_drafts.append(proposal)
        return SchedulerOutput(
            scheduled=scheduled,
            step_inputs=inputs,
            samples=samples,
            preempted=preempted,
            num_batched_tokens=cfg.max_num_batched_tokens - budget,
            num_decode_seqs=num_decode_seqs,
            drafts=entry_drafts,
        )

    def _add_proposals(self, scheduled: list[tuple[Sequence, int]], drafts: dict[int, list[int]], budget: int) -> int:
        """Gives the decoding entries of `scheduled` proposals to check, in order, from what the
        decodes left: the token budget and the free blocks (never a cached block, never
        preempting anyone). Returns the budget left."""
        if self.proposer is None:
            return budget
        for i, (seq, n) in enumerate(scheduled):
            proposal = self._propose(seq, budget)
            if proposal and self.block_manager.can_append_from_free(seq, n + len(proposal)):
                self.block_manager.may_append(seq, n + len(proposal))
                scheduled[i] = (seq, n + len(proposal))
                drafts[seq.seq_id] = proposal
                budget -= len(proposal)
        return budget

    def _propose(self, seq: Sequence, budget: int) -> list[int]:
        """Proposals for a decoding sequence: none for sequences that may not speculate, and
        none past `budget` tokens, max_tokens or max_model_len (the sequence gains at most
        proposals + 1 tokens)."""
        sp = seq.sampling_params
        if not speculation_allowed(sp, seq.num_output_tokens):
            return []
        room = self.config.max_model_len - seq.num_tokens - 1
        if sp.max_tokens is not None:
            room = min(room, sp.max_tokens - seq.num_output_tokens - 1)
        start = seq.num_tokens if self.proposer.needs_model else max(0, seq.num_tokens - NGRAM_LOOKBACK)
        return self.proposer.propose(seq.token_ids_slice(start, seq.num_tokens), min(room, budget))

    def postprocess(self, output: SchedulerOutput, sampled_token_ids: list[int] | list[list[int]] | dict[int, int],
                    on_append: Callable[[int, Sequence, int], None] | None = None) -> list[tuple[int, Sequence]]:  # fmt: skip
        """Takes a computed step's sampled tokens back.

        Args:
          output: what `schedule()` returned for the step.
          sampled_token_ids: one token per scheduled entry, in batch order (entries whose
            `samples` is False are ignored); or, for a step that checked proposals, a list per
            entry: its accepted proposals and the token sampled after them; or a dict seq_id ->
            token for the sampling entries. Python ints (use `.tolist()` on arrays).
          on_append: called as `on_append(batch index, sequence, j)` right after the entry's
            j-th token is appended (before the next; a sequence that finished on it, e.g. on a
            stop string, gets no more).

        Returns:
          `(batch index, sequence)` of every sequence a token was appended to (its
          `last_token_id`). Those that finished on a token-id rule (EOS, stop_token_ids,
          max_tokens, max_model_len) are `is_finished`, their blocks already freed.
        """
        now = time.time()
        appended = []
        drafts = output.drafts or [[]] * output.num_seqs
        for i, ((seq, n), samples, proposal) in enumerate(zip(output.scheduled, output.samples, drafts)):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted or finished since it was scheduled
            if not samples:
                seq.num_computed_tokens += n
                continue
            tokens = sampled_token_ids[seq.seq_id] if isinstance(sampled_token_ids, dict) else sampled_token_ids[i]
            tokens = tokens if isinstance(tokens, list) else [tokens]
            # K/V is right up to the last accepted proposal (its inputs were the sequence's tokens).
            seq.num_computed_tokens += n - len(proposal) + len(tokens) - 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            appended.append((i, seq))
            for j, token in enumerate(tokens):
                seq.output_token_ids.append(int(token))
                stop = self._check_stop(seq)
                if stop is not None:
                    self.finish_sequence(seq, *stop)
                if on_append is not None:
                    on_append(i, seq, j)
                if seq.is_finished:
                    break
            if proposal and not seq.is_finished:
                self.block_manager.trim(seq)  # blocks that held only rejected proposals
        return appended

    def reserve_lookahead(self, output: SchedulerOutput, num_steps: int) -> bool:
        """Gives this step's sequences the blocks for `num_steps` decode steps run as one device
        program (fused decode), if that is safe; otherwise reserves nothing.

        Safe when every scheduled sequence is decoding, nobody waits to be prefilled, none is
        still under min_tokens, all have budget for the extra tokens (nothing is written past
        max_tokens or max_model_len), and the pool has the blocks.
        """
        if output.num_decode_seqs != output.num_seqs or self.waiting or output.num_draft_tokens:
            return False
        bs, need = self.config.block_size, 0
        for seq, _ in output.scheduled:
            sp = seq.sampling_params
            if seq.num_output_tokens < sp.min_tokens or seq.num_output_tokens + num_steps > sp.max_tokens:
                return False
            if seq.num_tokens + num_steps > self.config.max_model_len:
                return False
            need += max(0, -(-(seq.num_computed_tokens + num_steps) // bs) - len(seq.block_table))
        if need > self.block_manager.num_free_blocks:
            return False
        for seq, _ in output.scheduled:
            self.block_manager.may_append(seq, num_steps)
        return True

    # -- stats ------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> dict[str, int | float]:
        """Gauges and counters under vLLM's metric names (without the `vllm:` prefix)."""
        bm = self.block_manager
        return {
            "num_requests_running": self.num_running,
            "num_requests_waiting": self.num_waiting,
            "kv_cache_usage_perc": bm.usage,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
        }

    # -- internals --------------------------------------------------------------------------

    def _make_room(self, seq: Sequence, n: int, chosen: set[int], preempted: list[Sequence]) -> bool:
        """Preempts from the tail (never a sequence in `chosen`) until `seq` can take `n` more
        tokens; False if `seq` itself had to go."""
        while not self.block_manager.can_append(seq, n):
            victim = next(s for s in reversed(self.running) if s.seq_id not in chosen)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if not (self.config.preemption_mode == "swap" and self.block_manager.swap_out(seq)):
            self.block_manager.deallocate(seq)  # by recompute
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _fork_parent(self, seq: Sequence) -> Sequence | None:
        """With prefix caching off, the running sibling whose computed prompt blocks `seq` can share."""
        if self.config.enable_prefix_caching:
            return None  # siblings already share through the prefix cache
        siblings = [s for s in self.running if s.request_id == seq.request_id]
        return max(siblings, key=lambda s: s.num_computed_tokens, default=None)

    def _check_stop(self, seq: Sequence) -> tuple[SequenceStatus, int | None] | None:
        sp, token = seq.sampling_params, seq.last_token_id
        if seq.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED, None
            if token in sp.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED, token
        if seq.num_tokens >= self.config.max_model_len or (
            sp.max_tokens is not None and seq.num_output_tokens >= sp.max_tokens
        ):
            return SequenceStatus.FINISHED_LENGTH, None
        return None
