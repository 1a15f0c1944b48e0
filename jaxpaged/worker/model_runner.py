"""The device side of the engine: parameters, the cache, the compiled step programs, one
transfer per step.

The programs (`StepPrograms`: a mixed step per token bucket, fused decode steps per decode
bucket) are all compiled by `warm_up`, so nothing compiles while serving.
"""

import dataclasses
import logging
import time

import jax
import numpy as np
from flax import nnx

from jaxpaged.config.engine_config import EngineConfig
from jaxpaged.core.host_tier import KVTransfers
from jaxpaged.core.step_inputs import ScheduledSequence
from jaxpaged.functional import DeviceCache, init_cache
from jaxpaged.model import Llama, unstack_layers
from jaxpaged.model.layer_arrays import place_params
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.parallel.multihost import EXECUTE, SEED, StepChannel
from jaxpaged.worker.kv_transfer import KVTransfer
from jaxpaged.worker.sampler import SampleResult
from jaxpaged.worker.step_packer import SequenceRow
from jaxpaged.worker.step_programs import Program, StepPrograms, compile_all

logger = logging.getLogger("jaxpaged")


class ModelRunner:
    """Runs engine steps on the device.

    Args:
      model: the NNX model (split once; its params are placed by the sharding table).
      parallel: the mesh and sharding table (one device: `TensorParallel.create(config)`).
      config: the engine's configuration, planned: the pool's `num_blocks` (the null block
        included), the scheduler's limits, `num_scheduler_steps` decode steps fused into one
        program when a batch is all decodes (1: no fusing). The pool holds `kv_cache_dtype`
        (the model's dtype with "auto"), stored in its `kv_storage_dtype`.
      kv_scales: an fp8 pool's `(k_scale [L], v_scale [L])`, e.g. a checkpoint's; None: 1.
    """

    def __init__(self, model: Llama, *, parallel: TensorParallel, config: EngineConfig,
                 kv_scales: tuple[np.ndarray, np.ndarray] | None = None):  # fmt: skip
        args = config.args
        self.config = model.config
        self.num_decode_steps = args.num_scheduler_steps
        self.parallel = parallel
        self.block_size = args.block_size
        self.max_num_seqs = max_num_seqs = args.max_num_seqs
        graphdef, params = nnx.split(model)
        self.params_dtype = model.embed[...].dtype
        self.kv_dtype = config.kv_dtype(self.params_dtype)
        self.step_programs = StepPrograms.for_engine(config, graphdef, parallel, self.kv_dtype)
        self.packer = self.step_programs.packer
        self.pages = self.packer.pages
        self.layouts = self.packer.layouts
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._slot_of: dict[int, int] = {}  # seq_id -> its penalty-table row and block-table row
        self.params = place_params(params, parallel)  # no copy when the loader placed them already
        if not model.scan_layers:  # unrolled layers read per-layer arrays (the engine's model comes split)
            self.params = unstack_layers(self.params, parallel.layer_sharding)
        self._whole = parallel.sharding()
        self.cache = self._zero_cache(config.num_blocks, self.kv_dtype, self.step_programs.cache_shardings)
        if kv_scales is not None and self.cache.kv.quant is not None:
            self._set_kv_scales(*kv_scales)
        self.kv_transfer = None  # the host tier's memory and copies
        if config.num_host_blocks:
            k = self.cache.kv.k
            self.kv_transfer = KVTransfer(parallel, self.step_programs.cache_shardings, num_layers=self.config.num_layers,
                                          num_host_blocks=config.num_host_blocks, block_shape=k.shape[1:],
                                          dtype=k.dtype)  # fmt: skip
        self.channel: StepChannel | None = None  # set on the leader of several processes
        self.compiled: dict[Program, object] = {}  # executables
        self.temp_bytes: dict[Program, int] = {}  # temporaries of each
        self._seed = None  # the compiled penalty-row seeding
        self.last_step: tuple[Program, np.ndarray] | None = None  # the latest executed program and buffer

    def _zero_cache(self, num_blocks: int, kv_dtype, shardings: DeviceCache) -> DeviceCache:
        """The cache made where it lives: the pool split over kv heads (no device ever holds the
        whole pool), the penalty tables whole on every device."""
        make = lambda: init_cache(self.config, num_blocks=num_blocks, block_size=self.block_size, dtype=kv_dtype,  # noqa: E731
                                  max_num_seqs=self.max_num_seqs, platform=self.parallel.platform)  # fmt: skip
        return jax.jit(make, out_shardings=shardings)()

    def _set_kv_scales(self, k_scale: np.ndarray, v_scale: np.ndarray) -> None:
        """An fp8 pool's per-layer scales, the same for every kv head of a layer."""
        quant = self.cache.kv.quant
        sharding = self.step_programs.cache_shardings.kv.quant.k_scale
        shape = quant.k_scale.shape  # [L, K]
        put = lambda s: jax.device_put(np.broadcast_to(np.asarray(s, np.float32)[:, None], shape), sharding)  # noqa: E731
        quant = dataclasses.replace(quant, k_scale=put(k_scale), v_scale=put(v_scale))
        self.cache = dataclasses.replace(self.cache, kv=dataclasses.replace(self.cache.kv, quant=quant))

    def programs(self) -> list[Program]:
        """Every program this engine compiles (see `StepPrograms.all`)."""
        return self.step_programs.all()

    def compile_program(self, program: Program):
        """Compiles (and keeps) one program; records its temporaries (XLA's memory analysis) in
        `temp_bytes`."""
        return self._keep(program, self.step_programs.lower(program, self.params, self.cache).compile())

    def _keep(self, program: Program, compiled):
        self.compiled[program] = compiled
        analysis = compiled.memory_analysis()
        self.temp_bytes[program] = int(getattr(analysis, "temp_size_in_bytes", 0) or 0)
        return compiled

    def warm_up(self, threads: int = 1) -> float:
        """Compiles every program (and the penalty-row seeding), `threads` at a time, logging each
        as it finishes; returns the seconds it took."""
        programs = self.programs()
        logger.info("compiling %d step programs (token buckets %s, fused decode steps %d) in %d thread(s)",
                    len(programs), sorted(self.layouts), self.num_decode_steps, threads)  # fmt: skip
        start = time.perf_counter()
        jobs = [(self.step_programs.describe(p), lambda p=p: self.step_programs.lower(p, self.params, self.cache))
                for p in programs]  # fmt: skip
        jobs.append(("penalty-row seeding", lambda: self.step_programs.lower_seed(self.cache)))
        if self.kv_transfer is not None:
            jobs += self.kv_transfer.lower(self.cache)
        results = compile_all(jobs, threads, logger.info)
        for program, result in zip(programs, results):
            self._keep(program, result.executable)
        self._seed = results[len(programs)].executable
        if self.kv_transfer is not None:
            self.kv_transfer.set_compiled([r.executable for r in results[len(programs) + 1 :]])
        seconds = time.perf_counter() - start
        logger.info("compiled %d step programs in %.1f s", len(self.compiled), seconds)
        return seconds

    def fusable(self, num_seqs: int) -> bool:
        """Whether a decode-only batch of `num_seqs` sequences has a fused-steps program."""
        t = self.packer.bucket_for(num_seqs, num_seqs)
        return self.num_decode_steps > 1 and Program(t, self.num_decode_steps, True) in self.compiled

    def acquire_slot(self, seq_id: int) -> tuple[int, bool]:
        """The penalty-table (and block-table) row of a running sequence: `(slot, new)`, a free
        one when it has none (new: the caller resets or seeds it)."""
        slot = self._slot_of.get(seq_id)
        if slot is not None:
            return slot, False
        slot = self._slot_of[seq_id] = self._free_slots.pop()
        return slot, True

    def release_slot(self, seq_id: int) -> None:
        """Gives a sequence's row back (finished, aborted or preempted); no-op if it has none."""
        slot = self._slot_of.pop(seq_id, None)
        if slot is not None:
            self.packer.release(slot)
            self._free_slots.append(slot)

    def seed_penalty_slot(self, slot: int, token_ids: list[int], prompt_len: int) -> None:
        """Resets penalty row `slot` and records tokens a sequence got from the prefix cache
        (the steps only see tokens they compute)."""
        size = self.pages * self.block_size
        ids = np.zeros(size, np.int32)
        ids[: len(token_ids)] = token_ids
        slots = np.full(size, self.max_num_seqs, np.int32)
        slots[: len(token_ids)] = slot
        is_output = np.arange(size) >= prompt_len
        if self.channel is not None:
            self.channel.send(SEED, (slot, prompt_len, len(token_ids)), ids)
        args = (ids, slots, is_output, np.array([slot], np.int32))
        seed = self._seed or self.step_programs.seed  # compiled by warm_up (else jit compiles it now)
        self.cache = seed(self.cache, *(jax.device_put(a, self._whole) for a in args))

    def move_kv(self, transfers: KVTransfers) -> None:
        """Carries out the host tier's copies (offloads, then loads) before the next step."""
        if transfers:
            self.cache = self.kv_transfer.run(self.cache, transfers)

    def execute(self, inputs: list[ScheduledSequence], rows: list[SequenceRow], resets: list[int],
                steps: int = 1, num_drafts: list[int] | None = None) -> SampleResult:  # fmt: skip
        """Packs, transfers and runs one step (or `steps` fused decode steps); returns the (not
        yet fetched) device result, stacked `[steps, ...]` when steps > 1. `num_drafts`: the
        proposals ending each sequence's tokens (speculative decoding; rows `[S * R]` then)."""
        t = self.packer.bucket_for(sum(len(s.token_ids) for s in inputs), len(inputs))
        # A decode batch takes the decode program when there is one of `steps` steps (with fused
        # decoding there is none of 1 step: a single decode step runs as a mixed one).
        program = Program(t, steps, True)
        if program not in self.compiled or any(len(s.token_ids) != 1 for s in inputs):
            program = Program(t, steps, False)
        if program not in self.compiled:
            raise RuntimeError(f"no compiled program {program}: call warm_up() first")
        t, flat = self.packer.pack(inputs, rows, resets, num_drafts, decode=program.decode)
        self.last_step = (program, flat)  # a draft model mirrors it
        if self.channel is not None:
            self.channel.send(EXECUTE, (program.tokens, program.steps, int(program.decode)), flat)
        return self.run_packed(program, flat)

    def run_packed(self, program: Program, flat: np.ndarray) -> SampleResult:
        """Runs a compiled program on a packed step buffer (the followers of a multi-process
        engine get both from the leader)."""
        self.cache, result = self.compiled[program](self.params, self.cache, jax.device_put(flat, self._whole))
        return result

    @staticmethod
    def program_from_fields(fields: tuple[int, ...]) -> Program:
        """The program the leader named in a step-channel header."""
        return Program(fields[0], fields[1], bool(fields[2]))
