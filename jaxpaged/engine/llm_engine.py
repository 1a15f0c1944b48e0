"""`LLMEngine`: continuous batching over the paged KV pool.

How a request flows:
  1. `add_request` tokenizes the prompt, validates its `SamplingParams`, resolves its seed
     and queues `n` `Sequence`s with the `Scheduler` (which rejects what can never fit). A
     constrained request (structured outputs, allowed_token_ids, bad_words) has its grammar
     built and compiled on the `GrammarBackend`'s threads, never on this one; each sequence
     gets its own `SequenceConstraint` (its matcher), and is not scheduled before its grammar
     is compiled. A grammar that fails to compile, allows nothing or cannot continue fails its
     request (`RequestOutput.error`, "invalid_request_error").
  2. `step()` is schedule -> execute -> postprocess -> outputs. The scheduler picks this
     step's batch: one decode token per running sequence, then prefill chunks, under
     `max_num_seqs` and `max_num_batched_tokens`; blocks come from the `BlockManager`
     (prefix-cached blocks are reused; when the pool is full the newest sequence is preempted
     and later recomputed or swapped back in).
  3. The `ModelRunner` runs the host tier's copies, packs the batch into one padded buffer,
     transfers it once and dispatches the compiled model and sampler programs with the cache
     donated; it returns at once, with the results' copy to the host under way.
  4. With async scheduling (the default) the previous step's results are read only now, while
     this step runs on the device: its sampled tokens reached this step on the device.
     `Scheduler.postprocess` appends them and applies token stop rules; what each sequence
     gained becomes a `SeqDelta`, which the `OutputProcessor` turns into logprobs, text and
     stop-string matches (here in `step()`; in the server's process when this engine runs in
     the engine-core process and returns deltas from `step_deltas()`); finished sequences give
     their blocks back (and, at the next step, their runner slots). Without async scheduling (and
     in steps that speculate, whose proposals follow the newest tokens) each step's results
     are read before the next is scheduled; with a draft model, reading a speculating step's
     results has the draft propose for the next step. A step with grammars (or other token
     masks) is dispatched in two halves: its model program at once, then, once the previous
     step's tokens have advanced the matchers, its packed token mask is filled
     (`fill_bitmask`) and its sampler program dispatched (`ModelRunner.sample`), so the mask work
     overlaps the step's forward pass on the device. A sequence whose grammar completes has one
     surplus step, dropped like one after EOS. While grammars run, each step is read before the
     next is scheduled (their forced runs are then known whole; with several processes the step
     channel also needs the masks before it sends a step).
  5. `step()` returns a `RequestOutput` for every request that changed.

Under pipeline parallelism a step is one pipeline tick (`PipelinedRunner`): the runner returns
the results of the micro-batch that left the last stage, scheduled P - 1 steps earlier, and the
scheduler passes over the sequences still in flight.
"""

import atexit
import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxpaged.core.scheduler import Scheduler
from jaxpaged.core.seq_delta import SeqDelta, seq_delta
from jaxpaged.core.sequence import Sequence
from jaxpaged.core.speculation import (
    SPEC_DECODE_COUNTERS,
    SPEC_DECODE_PER_POSITION,
    SpeculationGovernor,
    is_constrained,
    make_proposer,
)
from jaxpaged.engine.kv_event_publisher import KVEventPublisher
from jaxpaged.engine.lora_registry import LoraRegistry
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine.profiling import ProfilerControls
from jaxpaged.engine.setup import eos_token_ids, load_tokenizer, start_device_worker, start_disk_tier
from jaxpaged.engine.training_loop import TrainingLoopControls
from jaxpaged.engine_args import EngineArgs, EngineArgsError
from jaxpaged.engine_config import EngineConfig
from jaxpaged.lora_request import LoRARequest
from jaxpaged.outputs import RequestOutput
from jaxpaged.parallel.multihost import STOP
from jaxpaged.sampling_params import FLOAT32_MAX, SamplingParams, check_text
from jaxpaged.structured import GrammarBackend, SequenceConstraint, bad_words_token_ids
from jaxpaged.worker.input_batch import banned_ids
from jaxpaged.worker.model_runner import StepHandle
from jaxpaged.worker.step_fields import MAX_BANNED, MAX_LOGIT_BIAS


class LLMEngine(TrainingLoopControls, ProfilerControls):
    """The engine behind `LLM` and the server (vLLM's name and verbs; in a training loop also
    `get_params`, `update_weights`, `sleep`, `wake_up`, `pause_generation`, ...:
    `jaxpaged.engine.training_loop`).

    Args:
      args: the engine's options, resolved here against the model's configuration, or a
        configuration already resolved (`EngineConfig.resolve`, e.g. by the server, which checks
        it before the engine process starts): a process resolves its options once.
    """

    def __init__(self, args: EngineArgs | EngineConfig):
        node_rank = args.parallel.node_rank if isinstance(args, EngineConfig) else args.node_rank
        if node_rank != 0:
            raise EngineArgsError(
                "node_rank",
                node_rank,
                "only process 0 runs the engine; start the others "
                "with `jaxpaged serve --node-rank N` (they run process 0's steps)",
            )
        config = args if isinstance(args, EngineConfig) else EngineConfig.resolve(args)
        self.tokenizer = None if config.load.tokenizer is None else load_tokenizer(config.load.tokenizer)
        eos = frozenset(eos_token_ids(config, self.tokenizer))
        worker = start_device_worker(config, eos)
        self.config, self.plan, self.parallel = worker.config, worker.plan, worker.parallel
        self.runner, self.compile_seconds, self.draft = worker.runner, worker.compile_seconds, worker.draft
        if self.runner.channel is not None:
            atexit.register(self.shutdown)
        self.disk_tier = start_disk_tier(self.config, self.runner)  # its queued writes are done at exit too
        spec = self.config.speculative
        self.scheduler = Scheduler(
            self.config.scheduler_config(),
            eos_token_id=sorted(eos),
            disk_tier=self.disk_tier,
            proposer=make_proposer(spec),
        )
        # vLLM's speculative-decoding counters (with a speculative_config only).
        self.spec_stats = dict.fromkeys(SPEC_DECODE_COUNTERS, 0) if spec else {}
        self.spec_accepted_per_position = [0] * (spec.num_speculative_tokens if spec else 0)
        self._rng = np.random.default_rng(self.config.load.seed)
        self._seqs: dict[str, list[Sequence]] = {}  # unfinished requests' sequences, by request id
        self._aborted: list[Sequence] = []  # aborted since the last step (their deltas go out next)
        self.num_generation_tokens = 0  # tokens handed out in deltas
        self.output_processor = OutputProcessor(self.tokenizer, self.stop_on_string, self.abort_request)
        # Structured outputs: grammars compiled on their own threads, cached by grammar text.
        self.grammars = None if self.tokenizer is None else GrammarBackend(self.tokenizer, config.model.vocab_size, eos)
        self.governor = SpeculationGovernor(spec.disable_by_batch_size, adaptive=spec.adaptive) if spec else None
        self.loras = None  # the LoRA adapters asked for (enable_lora)
        if self.config.lora.enable_lora:
            layout = self.config.layout
            self.loras = LoraRegistry(self.config.model, self.config.lora, layout.kv_replicas, layout.mesh_config)
            self.runner.lora_weights = self.loras.weights
        self.num_prompt_tokens = 0
        events = self.config.cache.kv_events_config
        self.kv_events = (
            KVEventPublisher(events, self.config.parallel.data_parallel_rank)
            if events is not None and events.publishes
            else None
        )

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    def shutdown(self) -> None:
        """Releases the other processes of a multi-process engine (they exit their step loop) and
        finishes the disk tier's writes. The engine runs no more steps afterwards."""
        if self.disk_tier is not None:
            self.disk_tier.close()
        if self.grammars is not None:
            self.grammars.close()
        if self.kv_events is not None:
            self.kv_events.close()
        channel, self.runner.channel = self.runner.channel, None
        if channel is not None:
            channel.send(STOP, (), np.zeros(0, np.int32))

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queues a request; its outputs come from `step()`. Arguments and errors: `add_sequences`."""
        arrival = time.time() if arrival_time is None else arrival_time
        accepted = self.add_sequences(
            request_id, prompt, params, arrival_time=arrival, cache_salt=cache_salt, lora_request=lora_request
        )
        self.output_processor.add_request(request_id, *accepted, arrival)

    def add_sequences(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[str | None, list[int], SamplingParams]:
        """Validates and tokenizes a request and queues its `n` sequences with the scheduler, for
        an engine whose outputs are processed elsewhere (`step_deltas`); `add_request` is this plus
        the output side's bookkeeping.

        Args:
          request_id: unique among unfinished requests.
          prompt: text, `{"prompt": text}`, `{"prompt_token_ids": [...]}`, or a token-id list.
          params: sampling parameters (default: `EngineConfig.default_sampling_params()`, the
            model's generation config over `SamplingParams`' defaults).
          arrival_time: `time.time()` of arrival (default now).
          cache_salt: isolates this request's prefix-cache entries.
          lora_request: the LoRA adapter it runs with (an engine with `enable_lora`), or None.

        Returns:
          `(prompt text or None, prompt token ids, params with max_tokens and seed resolved)`; with
          `params.truncate_prompt_tokens` the ids are the prompt's last k (and the text None when
          that dropped any).

        Raises:
          ValueError: duplicate id, a bad prompt, or a request that can never fit.
        """
        params = params if params is not None else self.config.default_sampling_params()
        if request_id in self._seqs or request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        most = self.config.scheduling.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > most:
                raise ValueError(
                    f"SamplingParams.{name}={asked} exceeds the maximum of {most} (the engine's max_logprobs)"
                )
        if params.logit_bias:
            self._check_logit_bias(params.logit_bias)
        if params.min_tokens and len(banned_ids(params, self.scheduler.eos_token_ids)) > MAX_BANNED:
            raise ValueError(
                f"with min_tokens > 0, at most {MAX_BANNED} stop_token_ids plus EOS ids are supported; "
                f"got {len(params.stop_token_ids)} stop_token_ids"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; the engine runs with skip_tokenizer_init=True")
        if cache_salt is not None:
            check_text("cache_salt", cache_salt)
        lora = None
        if lora_request is not None:
            if self.loras is None:
                raise ValueError(
                    f"the request asks for LoRA adapter {getattr(lora_request, 'lora_name', lora_request)!r}; "
                    "start the engine with enable_lora=True (--enable-lora)"
                )
            lora = self.loras.register(lora_request)  # its key: its blocks cached apart from others'
            cache_salt = f"{cache_salt or ''}\x00{lora}"
        make_constraint = self._constraint_factory(params)
        text, token_ids = self._tokenize(prompt)
        if params.truncate_prompt_tokens is not None:  # keep the last k tokens (-1: max_model_len)
            keep = params.truncate_prompt_tokens
            keep = self.config.max_model_len if keep == -1 else keep
            if len(token_ids) > keep:
                text, token_ids = None, token_ids[-keep:]  # the text no longer matches the tokens
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
            seq.constraint = make_constraint()  # each sequence its own matcher
            seq.lora = lora
            seq.lora_name = None if lora_request is None else lora_request.lora_name
            try:
                self.scheduler.add(seq)
            except ValueError:
                self.scheduler.abort(request_id) if i else None
                raise
        self._seqs[request_id] = seqs
        self.num_prompt_tokens += len(token_ids)
        return text, token_ids, params

    def _check_logit_bias(self, logit_bias: dict) -> None:
        """At most `MAX_LOGIT_BIAS` entries, ids in the vocabulary, finite float32 biases."""
        if len(logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(
                f"SamplingParams.logit_bias has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS} are supported"
            )
        vocab_size = self.config.model.vocab_size
        bad = [t for t in logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(
                f"SamplingParams.logit_bias token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
            )
        if not all(abs(v) <= FLOAT32_MAX for v in logit_bias.values()):  # also refuses NaN
            raise ValueError("SamplingParams.logit_bias values must be finite numbers")

    def _constraint_factory(self, params: SamplingParams) -> Callable[[], SequenceConstraint | None]:
        """Validates a request's token constraints and starts its grammar's compilation on the
        grammar threads (nothing of the grammar runs on this thread: a grammar that fails fails its
        request with `Sequence.error`; the front doors, `LLM.generate` and the server, check it
        first); returns what makes each of its sequences' `constraint`.

        Raises:
          ValueError: naming the field (`structured_outputs.<kind>: ...`, `allowed_token_ids`,
            `bad_words`).
        """
        if not is_constrained(params):
            return lambda: None
        vocab_size = self.config.model.vocab_size
        if (params.structured_outputs is not None or params.bad_words) and self.grammars is None:
            field = "structured_outputs" if params.structured_outputs is not None else "bad_words"
            raise ValueError(f"{field} needs a tokenizer; the engine runs with skip_tokenizer_init=True")
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.grammars.compile(params.structured_outputs)
        allowed = params.allowed_token_ids
        if allowed is not None and max(allowed) >= vocab_size:
            bad = [t for t in allowed if t >= vocab_size]
            raise ValueError(f"allowed_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        bad_words = bad_words_token_ids(params.bad_words, self.tokenizer) if params.bad_words else None
        valid_ids = None if self.grammars is None else self.grammars.valid_ids
        return lambda: SequenceConstraint(vocab_size, grammar, valid_ids, allowed, bad_words)

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
        """Aborts unfinished requests; their blocks return to the pool at once (a step in flight
        still computes their tokens, which are dropped). Their final deltas (outputs) come with
        the next step."""
        self._aborted += self.scheduler.abort(request_id)

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Reads and checks a LoRA adapter now (vLLM's `add_lora`; requests naming it later start
        without reading it). Returns True.

        Raises:
          ValueError: LoRA is off, or the adapter is refused (named, with the reason)."""
        if self.loras is None:
            raise ValueError("add_lora: the engine runs without LoRA; start it with enable_lora=True")
        self.loras.register(lora_request)
        return True

    def remove_lora(self, lora_name: str) -> bool:
        """Forgets an adapter's name (vLLM's `remove_lora`, by name): requests already queued
        with it finish with it; a later adapter of that name is another adapter. Returns whether
        the name was known."""
        return self.loras is not None and self.loras.remove(lora_name, self._loras_in_use())

    def _loras_in_use(self) -> set[str]:
        """The adapters (registration keys) of unfinished sequences."""
        return {seq.lora for seqs in self._seqs.values() for seq in seqs if seq.lora}

    def stop_on_string(self, request_id: str, index: int, num_output_tokens: int, stop: str) -> None:
        """Finishes a sequence that the output side found a stop string in, ending at its
        `num_output_tokens`-th output token (`Scheduler.stop_on_string`); ignored once the request
        is finished."""
        seqs = self._seqs.get(request_id)
        if seqs is not None:
            self.scheduler.stop_on_string(seqs[index], num_output_tokens, stop)
            self._forget_if_finished(request_id)

    def unfinished_request_ids(self) -> list[str]:
        """The ids of requests with a sequence not finished yet."""
        return list(self._seqs)

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has work: unfinished sequences (not while paused or asleep, when steps
        schedule nothing), a step in flight, or aborts to deliver."""
        waiting = self.scheduler.has_unfinished() and not (self._paused or self._slept is not None)
        return waiting or self.runner.busy or bool(self._aborted)

    # -- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one engine step: schedule -> execute -> postprocess -> outputs. With async
        scheduling the step postprocesses the previous step's results, read while this one runs.
        Returns the outputs of requests that changed (for `RequestOutputKind.FINAL_ONLY`
        requests, only once they finish)."""
        self._step(self.output_processor.process)
        return self.output_processor.outputs()

    def step_deltas(self) -> list[SeqDelta]:
        """Runs one engine step like `step()` for an engine whose outputs are processed elsewhere
        (the engine-core process): returns what each sequence gained, for requests added with
        `add_sequences`. Stop strings come back through `stop_on_string`."""
        deltas: list[SeqDelta] = []
        self._step(deltas.extend)
        return deltas

    def _step(self, emit: Callable[[list[SeqDelta]], None]) -> None:
        """Schedule -> execute -> postprocess what is ready; each postprocessed step's deltas go
        to `emit` at once (a stop string found there finishes its sequence before the next
        schedule). When a step may be read is the runner's to say (`ModelRunner`'s module doc)."""
        if self._aborted:
            aborted, self._aborted = self._aborted, []
            emit(self._deltas([(seq, 0, None) for seq in aborted]))
        if self._idle():  # paused or asleep: only the steps already dispatched are read
            emit(self._postprocess(self.runner.read_all()))
            return
        start, tokens, running = time.perf_counter(), self.num_generation_tokens, self.scheduler.num_running
        propose = self.governor is not None and self.governor.speculate(running)
        emit(self._postprocess(self.runner.read_before_schedule(propose, self.scheduler.needs_last_tokens)))
        output = self.scheduler.schedule(propose=propose, in_flight=self.runner.in_flight_seq_ids)
        self._aborted += output.failed  # their grammar failed: finished with `Sequence.error`
        previous = self.runner.execute(output)  # the steps before it, read while it runs
        self.scheduler.copies_done(output)
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.take_kv_events())
        emit(self._postprocess(previous))
        emit(self._postprocess(self.runner.sample()))  # its masked samplers; itself if it is read now
        if self.governor is not None and output.num_decode_seqs:
            self.governor.record(running, propose, time.perf_counter() - start, self.num_generation_tokens - tokens)

    def _postprocess(self, handles: list[StepHandle]) -> list[SeqDelta]:
        """Reads steps' results (waiting for the device), oldest first, appends their tokens;
        returns the deltas."""
        return [delta for handle in handles for delta in self._postprocess_one(handle)]

    def _postprocess_one(self, handle: StepHandle) -> list[SeqDelta]:
        result = self.runner.fetch(handle)
        for i, (first, *arrays) in result.prompt_logprobs.items():
            seq = handle.output.scheduled[i][0]
            if seq.needs_prompt_logprobs:  # (aborted sequences hold theirs still)
                seq.prompt_logprobs.record(first, *arrays)
        if result.num_accepted is not None:
            self._count_speculation(result.num_drafts, result.num_accepted)
        appended = self.scheduler.postprocess(handle.output, result.tokens, result.proposals)
        return self._deltas([(seq, count, functools.partial(result.sample, i)) for i, seq, count in appended])

    def _deltas(self, changes: list[tuple[Sequence, int, Callable | None]]) -> list[SeqDelta]:
        """The deltas of `(sequence, tokens appended, sample)` changes; forgets finished requests."""
        deltas = [seq_delta(seq, count, sample) for seq, count, sample in changes]
        self.num_generation_tokens += sum(len(d.token_ids) for d in deltas)
        for seq, _, _ in changes:
            if seq.is_finished:
                self._forget_if_finished(seq.request_id)
        return deltas

    def _forget_if_finished(self, request_id: str) -> None:
        seqs = self._seqs.get(request_id)
        if seqs is not None and all(seq.is_finished for seq in seqs):
            del self._seqs[request_id]

    def _lora_stats(self) -> dict:
        """vLLM's `lora_requests_info`: the adapters of running and of waiting requests, by name."""
        if self.loras is None:
            return {}
        names = lambda seqs: ",".join(sorted({self.loras.requests[s.lora].lora_name for s in seqs if s.lora}))  # noqa: E731
        return {
            "lora_requests_info": {
                "max_lora": str(self.config.lora.max_loras),
                "running_lora_adapters": names(self.scheduler.running),
                "waiting_lora_adapters": names(self.scheduler.waiting),
            }
        }

    def _count_speculation(self, num_drafts: list[int], accepted: list[int]) -> None:
        """Speculative decoding's counters (vLLM's): proposals made and kept, by position."""
        for k, a in zip(num_drafts, accepted):
            if k:
                self.spec_stats["spec_decode_num_drafts"] += 1
                self.spec_stats["spec_decode_num_draft_tokens"] += k
                self.spec_stats["spec_decode_num_accepted_tokens"] += a
                for position in range(a):
                    self.spec_accepted_per_position[position] += 1

    # -- stats ------------------------------------------------------------------------------

    def get_stats(self) -> dict[str, Any]:
        """Gauges and counters (vLLM's names), each component's own: the scheduler's and the KV
        cache's (`Scheduler.stats`), the tokens handed out, the grammars', the LoRA adapters' (vLLM's
        `lora_requests_info`), the device memory's and speculative decoding's."""
        transfer = self.runner.kv_transfer
        return {
            **self.scheduler.stats(0 if transfer is None else transfer.block_bytes),
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            **(self.grammars.stats() if self.grammars is not None else {}),
            **self._lora_stats(),
            **self.device_memory_stats(),
            **self.spec_stats,
            **({SPEC_DECODE_PER_POSITION: list(self.spec_accepted_per_position)} if self.spec_stats else {}),
        }
