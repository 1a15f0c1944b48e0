"""`LLMEngine`: continuous batching over the paged KV pool.

How a request flows:
  1. `add_request` tokenizes the prompt, validates its `SamplingParams`, resolves its seed
     and queues `n` `Sequence`s with the `Scheduler` (which rejects what can never fit).
  2. `step()` asks the scheduler for this step's batch: one decode token per running
     sequence, then prefill chunks, under `max_num_seqs` and `max_num_batched_tokens`;
     blocks come from the `BlockManager` (prefix-cached blocks are reused; when the pool is
     full the newest sequence is preempted and later recomputed).
  3. The `ModelRunner` packs the batch into one padded buffer, transfers it once and runs
     the compiled step (model + sampler) with the cache donated.
  4. The sampled tokens come back; `Scheduler.postprocess` appends them and applies token
     stop rules; each completion's detokenizer turns tokens into text and matches stop
     strings; finished sequences give their blocks and penalty-table slots back.
  5. `step()` returns a `RequestOutput` for every request that changed.
"""

import atexit
import dataclasses
import logging
import time
from typing import Any

import numpy as np
from transformers import AutoTokenizer

from jaxpaged.config.engine_args import EngineArgs, EngineArgsError
from jaxpaged.config.engine_config import EngineConfig
from jaxpaged.core.request_state import RequestState
from jaxpaged.core.scheduler import Scheduler, SchedulerOutput
from jaxpaged.core.sequence import Sequence, SequenceStatus
from jaxpaged.core.host_tier import KVTransfers
from jaxpaged.core.speculation import SPEC_DECODE_COUNTERS, SPEC_DECODE_PER_POSITION, make_proposer
from jaxpaged.core.step_inputs import ScheduledSequence
from jaxpaged.engine.setup import eos_token_ids, start_device_worker, start_disk_tier
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.parallel.multihost import STOP
from jaxpaged.sampling_params import SamplingParams, check_text
from jaxpaged.worker.sampler import MAX_LOGPROBS
from jaxpaged.worker.step_packer import MAX_BANNED, SequenceRow, sampling_row

logger = logging.getLogger("jaxpaged")


class LLMEngine:
    """The engine behind `LLM` and the server (vLLM's name and verbs).

    Args:
      args: the engine configuration.
    """

    def __init__(self, args: EngineArgs):
        if args.node_rank != 0:
            raise EngineArgsError("node_rank", args.node_rank, "only process 0 runs the engine; start the others "
                                  "with `jaxpaged serve --node-rank N` (they run process 0's steps)")  # fmt: skip
        config = EngineConfig.resolve(args)
        self.args = args = config.args
        self.tokenizer = None if args.skip_tokenizer_init else AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        worker = start_device_worker(config)
        self.config, self.plan, self.parallel = worker.config, worker.plan, worker.parallel
        self.runner, self.compile_seconds, self.draft = worker.runner, worker.compile_seconds, worker.draft
        if self.runner.channel is not None:
            atexit.register(self.shutdown)
        self.disk_tier = start_disk_tier(self.config, self.runner)  # its queued writes are done at exit too
        spec = args.speculative_config
        self.scheduler = Scheduler(self.config.scheduler_config(),
                                   eos_token_id=sorted(eos_token_ids(args, self.config.model, self.tokenizer)),
                                   disk_tier=self.disk_tier, proposer=make_proposer(spec))  # fmt: skip
        # vLLM's speculative-decoding counters (with a speculative_config only).
        self.spec_stats = dict.fromkeys(SPEC_DECODE_COUNTERS, 0) if spec else {}
        self.spec_accepted_per_position = [0] * (spec.num_speculative_tokens if spec else 0)
        self.requests: dict[str, RequestState] = {}
        self._rng = np.random.default_rng(args.seed)
        self._rows: dict[int, np.ndarray] = {}
        self._changed: set[str] = set()
        self._failed: dict[str, str] = {}  # request id -> why, until its output is returned
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def shutdown(self) -> None:
        """Releases the other processes of a multi-process engine (they exit their step loop) and
        finishes the disk tier's writes. The engine runs no more steps afterwards."""
        if self.disk_tier is not None:
            self.disk_tier.close()
        channel, self.runner.channel = self.runner.channel, None
        if channel is not None:
            channel.send(STOP, (), np.zeros(0, np.int32))

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, cache_salt: str | None = None) -> None:  # fmt: skip
        """Queues a request.

        Args:
          request_id: unique among unfinished requests.
          prompt: text, `{"prompt": text}`, `{"prompt_token_ids": [...]}`, or a token-id list.
          params: sampling parameters (default `SamplingParams()`).
          arrival_time: `time.time()` of arrival (default now).
          cache_salt: isolates this request's prefix-cache entries.

        Raises:
          ValueError: duplicate id, a bad prompt, or a request that can never fit.
        """
        params = params if params is not None else SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.logprobs is not None and params.logprobs > MAX_LOGPROBS:
            raise ValueError(f"SamplingParams.logprobs={params.logprobs} exceeds the maximum of {MAX_LOGPROBS}")
        if params.min_tokens and len(self._banned_ids(params)) > MAX_BANNED:
            raise ValueError(
                f"with min_tokens > 0, at most {MAX_BANNED} stop_token_ids plus EOS ids are supported; "
                f"got {len(params.stop_token_ids)} stop_token_ids"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; the engine runs with skip_tokenizer_init=True")
        if cache_salt is not None:
            check_text("cache_salt", cache_salt)
        text, token_ids = self._tokenize(prompt)
        vocab_size = self.config.model.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        if params.max_tokens is None:
            params = dataclasses.replace(params, max_tokens=max(self.config.max_model_len - len(token_ids), 1))
        if params.seed is None:
            params = dataclasses.replace(params, seed=int(self._rng.integers(0, 2**31 - 1)))
        arrival = time.time() if arrival_time is None else arrival_time
        seqs = [
            Sequence(request_id, token_ids, params, index=i, arrival_time=arrival, cache_salt=cache_salt)
            for i in range(params.n)
        ]
        for i, seq in enumerate(seqs):
            try:
                self.scheduler.add(seq)
            except ValueError:
                self.scheduler.abort(request_id) if i else None
                raise
        self.requests[request_id] = RequestState(request_id, text, token_ids, params, seqs, self.tokenizer)
        self.num_prompt_tokens += len(token_ids)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            if self.tokenizer is None:
                raise ValueError("the engine runs with skip_tokenizer_init=True: give {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def abort_request(self, request_id: str | list[str]) -> None:
        """Aborts unfinished requests; their blocks return to the pool at once."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for seq in self.scheduler.abort(ids):
            self._release(seq)
        self._changed.update(i for i in ids if i in self.requests)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one engine step; returns the outputs of requests that changed (for
        `RequestOutputKind.FINAL_ONLY` requests, only once they finish)."""
        out = self.scheduler.schedule()
        for seq in out.preempted:
            self._release(seq)
        if not out.is_empty:
            self._run(out)
        else:  # copies planned while preempting are due before any later step
            self._move_kv(self.scheduler.block_manager.take_transfers())
        outputs = []
        for request_id in sorted(self._changed, key=lambda r: self.requests[r].completions[0].seq.seq_id):
            state = self.requests[request_id]
            if state.final_only and not state.finished:
                continue
            output = self._guarded(request_id, state.make_output)
            outputs.append(output if output is not None else self._failed_output(request_id))
            if state.finished:
                del self.requests[request_id]
        self._changed.clear()
        self._failed.clear()
        return outputs

    # -- failures of one request ------------------------------------------------------------

    def _guarded(self, request_id: str, fn, *args):
        """Runs one request's host work; if it raises, that request fails and the step goes on."""
        if request_id in self._failed:
            return None
        try:
            return fn(*args)
        except Exception as err:
            logger.exception("request %s failed; the engine goes on without it", request_id)
            self._failed[request_id] = f"processing the request failed ({type(err).__name__})"
            for seq in self.scheduler.abort(request_id):
                self._release(seq)
            self._changed.add(request_id)
            return None

    def _failed_output(self, request_id: str) -> RequestOutput:
        state = self.requests[request_id]
        outs = [CompletionOutput(index=c.seq.index, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                 finish_reason="error") for c in state.completions]  # fmt: skip
        return RequestOutput(request_id, state.prompt, state.prompt_token_ids, outs, finished=True,
                             error=self._failed[request_id])  # fmt: skip

    def _run(self, out: SchedulerOutput) -> None:
        rows, resets = [], []
        for seq, _ in out.scheduled:
            slot, new = self.runner.acquire_slot(seq.seq_id)
            sp = seq.sampling_params
            if new:
                if seq.num_computed_tokens and _has_penalties(sp):
                    computed = seq.token_ids_slice(0, seq.num_computed_tokens)
                    self.runner.seed_penalty_slot(slot, computed, seq.num_prompt_tokens)
                else:
                    resets.append(slot)
            row = self._rows.get(seq.seq_id)
            if row is None:
                row = self._rows[seq.seq_id] = sampling_row(sp, seq.index)
            banned = self._banned_ids(sp) if seq.num_output_tokens < sp.min_tokens else ()
            rows.append(SequenceRow(seq.seq_id, row, slot, seq.num_prompt_tokens, bool(sp.logprobs), banned))
        steps = self._fused_steps(out)  # may take blocks too: the copies are planned only now
        self._move_kv(self.scheduler.block_manager.take_transfers())
        if self.draft is not None:
            self._draft_proposals(out, rows)
        num_drafts = [len(d) for d in out.drafts]
        result = self.runner.execute(out.step_inputs, rows, resets, steps, num_drafts)
        if self.draft is not None:  # the draft's pool gets the K/V of what the target computed
            program, flat = self.runner.last_step  # a copy: the next step repacks that buffer while
            self.draft.mirror(program, flat.copy())  # the draft may still read it (CPU puts alias)
        n = out.num_seqs
        want_top = any(r.want_logprobs for r in rows)
        names = ("token_ids", "logprobs") + (("ranks", "top_ids", "top_logprobs") if want_top else ())
        # R rows per sequence: 1 + k in a step that may check k proposals per sequence.
        r = 1 if result.num_accepted is None else self.config.args.speculative_config.num_speculative_tokens + 1
        fetched = {}  # name -> [steps, n, R, ...]
        for name in names:
            value = np.asarray(getattr(result, name))
            value = value if steps > 1 else value[None]
            fetched[name] = value[:, : n * r].reshape(steps, n, r, *value.shape[2:])

        def record(j: int, i: int, seq: Sequence, k: int) -> None:
            sample = {name: values[j, i, k] for name, values in fetched.items()}
            self._guarded(seq.request_id, self._record, seq, sample)

        if result.num_accepted is not None:  # each sequence's accepted proposals and the token after them
            accepted = np.asarray(result.num_accepted)[:n]
            self._count_speculation(num_drafts, accepted)
            tokens = [fetched["token_ids"][0, i, : a + 1].tolist() for i, a in enumerate(accepted)]
            self.scheduler.postprocess(out, tokens, lambda i, seq, k: record(0, i, seq, k))
        else:
            for j in range(steps):
                self.scheduler.postprocess(out, fetched["token_ids"][j, :, 0].tolist(),
                                           lambda i, seq, k, j=j: record(j, i, seq, 0))  # fmt: skip
        self._move_kv(self.scheduler.block_manager.take_stores())  # write-through of what the step computed

    def _move_kv(self, transfers: KVTransfers) -> None:
        """Runs the host tier's copies; with a disk tier, queues the blocks that reached host slots
        under a prefix hash for writing to disk."""
        self.runner.move_kv(transfers)
        if self.disk_tier is not None:
            tier = self.scheduler.block_manager.host_tier
            for _, slot in transfers.offloads:
                block_hash = tier.hash_of(slot)
                if block_hash is not None:  # a swapped-out sequence's slots have none
                    self.disk_tier.save(block_hash, slot)

    def _fused_steps(self, out: SchedulerOutput) -> int:
        """How many decode steps to fuse into this step's program (1 = no fusing): the runner
        must have the program and the scheduler must reserve the blocks."""
        k = self.args.num_scheduler_steps  # 1 with a draft model (see EngineConfig.resolve)
        if k > 1 and self.runner.fusable(out.num_seqs) and self.scheduler.reserve_lookahead(out, k):
            return k
        return 1

    def _draft_proposals(self, out: SchedulerOutput, rows: list[SequenceRow]) -> None:
        """Fills the proposal slots the scheduler reserved with the draft model's tokens."""
        drafting = [i for i, d in enumerate(out.drafts) if d]
        if not drafting:
            return
        inputs = [ScheduledSequence(out.step_inputs[i].token_ids[:1], out.step_inputs[i].num_computed,
                                    out.step_inputs[i].block_table) for i in drafting]  # fmt: skip
        tokens = self.draft.propose(inputs, [rows[i] for i in drafting])
        for i, own, proposal in zip(drafting, inputs, tokens.tolist()):
            out.drafts[i] = proposal
            out.step_inputs[i] = dataclasses.replace(out.step_inputs[i], token_ids=own.token_ids + proposal)

    def _count_speculation(self, num_drafts: list[int], accepted: np.ndarray) -> None:
        """Speculative decoding's counters (vLLM's): proposals made and kept, by position."""
        for k, a in zip(num_drafts, accepted.tolist()):
            if k:
                self.spec_stats["spec_decode_num_drafts"] += 1
                self.spec_stats["spec_decode_num_draft_tokens"] += k
                self.spec_stats["spec_decode_num_accepted_tokens"] += a
                for position in range(a):
                    self.spec_accepted_per_position[position] += 1

    def _record(self, seq: Sequence, sample: dict[str, Any]) -> None:
        """Logprobs, detokenization and stop strings for the token just appended to `seq`
        (`sample` holds this token's entries of the fetched step results)."""
        state = self.requests[seq.request_id]
        completion = state.completions[seq.index]
        token = seq.output_token_ids[-1]
        self.num_generation_tokens += 1
        if "top_ids" in sample:
            state.record_logprobs(completion, token, float(sample["logprobs"]), int(sample["ranks"]),
                                  sample["top_ids"], sample["top_logprobs"])  # fmt: skip
        else:
            state.record_logprobs(completion, token, float(sample["logprobs"]), 0, (), ())
        if completion.detokenizer.add_token(token):
            stop = completion.detokenizer.stop_reason
            if seq.is_finished:  # finished on length too: the stop string wins, as in vLLM
                seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
            else:
                self.scheduler.finish_sequence(seq, SequenceStatus.FINISHED_STOPPED, stop)
        if seq.is_finished:
            self._release(seq)
        self._changed.add(seq.request_id)

    def _banned_ids(self, sp: SamplingParams) -> tuple[int, ...]:
        """Before min_tokens, EOS (unless ignored) and the stop token ids cannot be sampled."""
        eos = () if sp.ignore_eos else tuple(self.scheduler.eos_token_ids)
        return tuple(sorted(set(eos) | set(sp.stop_token_ids)))

    def _release(self, seq: Sequence) -> None:
        """Gives back a sequence's penalty-table slot (finished, aborted or preempted)."""
        self.runner.release_slot(seq.seq_id)
        if seq.is_finished:
            self._rows.pop(seq.seq_id, None)

    # -- stats ------------------------------------------------------------------------------

    def get_stats(self) -> dict[str, float | int]:
        """Cache and scheduler gauges and counters (vLLM's names)."""
        bm = self.scheduler.block_manager
        return {
            "gpu_cache_usage_perc": bm.usage,
            "num_total_blocks": bm.num_total_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_cached_tokens": len(bm.cached_block_hash_to_block) * bm.block_size,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            **self._host_tier_stats(),
            **self.spec_stats,
            **({SPEC_DECODE_PER_POSITION: list(self.spec_accepted_per_position)} if self.spec_stats else {}),
        }

    def _host_tier_stats(self) -> dict[str, int]:
        """The host tier's counters (none without one): prefix hits there under vLLM's names for
        an external KV cache, blocks and bytes moved under jaxpaged's."""
        tier, transfer = self.scheduler.block_manager.host_tier, self.runner.kv_transfer
        if tier is None:
            return {}
        return {
            "external_prefix_cache_queries": tier.queries,
            "external_prefix_cache_hits": tier.hits,
            "kv_host_tier_blocks": tier.num_slots,
            "kv_host_tier_cached_blocks": len(tier.cached),
            "kv_host_tier_swapped_blocks": tier.num_swapped,
            "kv_offload_bytes": tier.offloaded_blocks * transfer.block_bytes,
            "kv_load_bytes": tier.loaded_blocks * transfer.block_bytes,
            "kv_swapped_out_blocks": tier.swapped_out_blocks,
            "kv_swapped_in_blocks": tier.swapped_in_blocks,
            **self._disk_tier_stats(),
        }

    def _disk_tier_stats(self) -> dict[str, int]:
        disk = self.disk_tier
        if disk is None:
            return {}
        return {
            "kv_disk_hit_tokens": disk.hits * self.scheduler.config.block_size,
            "kv_disk_read_bytes": disk.read_bytes,
            "kv_disk_write_bytes": disk.write_bytes,
            "kv_disk_blocks": disk.num_files,
            "kv_disk_rejected_files": disk.rejected,
            "kv_disk_dropped_writes": disk.dropped_writes,
        }


def _has_penalties(sp: SamplingParams) -> bool:
    return sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1

