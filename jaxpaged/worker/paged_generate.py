"""The simplest generation loop through the paged KV pool: a reference beside the engine.

All prompts are prefilled together (or one prompt in chunks), then decoded greedily together,
one token per step, through the same packed step inputs, block tables and write-then-attend
model as the engine, but without scheduling, caching or sampling. Tests use it to compare
every position's logits with transformers; it also shows the model API in a few lines.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.core.step_inputs import ScheduledSequence
from jaxpaged.model import KVPool, Llama, init_kv_pool
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.step_packer import Layout, SequenceRow, StepPacker, sampling_row
from jaxpaged.worker.step_programs import unpack


@functools.partial(jax.jit, static_argnums=(0, 1, 5), donate_argnums=(3,))
def _forward(layout: Layout, graphdef, state, kv_pool: KVPool, flat, every_token: bool):
    """One packed step; float32 logits of every token (or each sequence's last) and the pool."""
    inp = unpack(layout, flat)
    model = nnx.merge(graphdef, state)
    hidden, kv_pool = model(inp.token_ids, kv_pool, inp.metadata)
    return model.compute_logits(hidden if every_token else hidden[inp.logits_indices]), kv_pool


class PagedGenerator:
    """Greedy generation and prompt logits through a paged pool.

    Args:
      model: the NNX model (split once; steps are jitted functions of its state).
      block_size: tokens per pool block.
      block_shuffle_seed: when set, sequences get pool blocks in a random order (tests use
        this to prove nothing relies on contiguous blocks); otherwise blocks 1, 2, 3, ...
      kv_dtype: the pool's dtype (e.g. "float8_e4m3fn"); None: the model's.
    """

    def __init__(
        self, model: Llama, *, block_size: int = 16, block_shuffle_seed: int | None = None, kv_dtype: str | None = None
    ):
        self.config = model.config
        self.pool_config = model.pool_config  # under pipeline parallelism: every stage's layer slots
        self.parallel = model.parallel
        self.dtype = kv_dtype or model.embed[...].dtype
        self.graphdef, self.state = nnx.split(model)
        self.block_size = block_size
        self.block_shuffle_seed = block_shuffle_seed

    def _setup(self, lengths: list[int], max_step_tokens: int):
        """A fresh pool, one block table per sequence able to hold `lengths` tokens, a packer."""
        pages = [-(-n // self.block_size) for n in lengths]
        block_ids = np.arange(1, sum(pages) + 1)  # block 0 is the null block
        if self.block_shuffle_seed is not None:
            np.random.default_rng(self.block_shuffle_seed).shuffle(block_ids)
        tables = np.split(block_ids, np.cumsum(pages)[:-1])
        pool = init_kv_pool(self.pool_config, sum(pages) + 1, self.block_size, self.dtype)
        if self.parallel is not None:  # split as the engine's (over kv heads, and the stages' blocks)
            pool = dataclasses.replace(
                pool,
                k=jax.device_put(pool.k, self.parallel.pool_sharding),
                v=jax.device_put(pool.v, self.parallel.pool_sharding),
            )
        packer = StepPacker(
            block_size=self.block_size,
            max_model_len=max(lengths),
            max_num_seqs=len(lengths),
            max_num_batched_tokens=max_step_tokens,
            vocab_size=self.config.vocab_size,
        )
        return pool, [t.tolist() for t in tables], packer

    def _step(
        self,
        packer: StepPacker,
        pool: KVPool,
        seqs: list[ScheduledSequence],
        ids: list[int],
        prompt_lens: list[int],
        every_token: bool,
    ):
        row = sampling_row(SamplingParams(temperature=0), 0)
        rows = [SequenceRow(i, row, i, n) for i, n in zip(ids, prompt_lens)]
        t, flat = packer.pack(seqs, rows, [])
        return _forward(packer.layouts[t], self.graphdef, self.state, pool, jnp.asarray(flat), every_token)

    def prompt_logits(self, prompt: list[int], chunk_size: int | None = None) -> np.ndarray:
        """Float32 logits `[len(prompt), V]` of every prompt position, prefilled through the pool
        in chunks of `chunk_size` tokens (one chunk when None)."""
        chunk_size = chunk_size or len(prompt)
        pool, (table,), packer = self._setup([len(prompt)], chunk_size)
        rows = []
        for start in range(0, len(prompt), chunk_size):
            chunk = prompt[start : start + chunk_size]
            logits, pool = self._step(packer, pool, [ScheduledSequence(chunk, start, table)], [0], [len(prompt)], True)
            rows.append(np.asarray(logits)[: len(chunk)])
        return np.concatenate(rows)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations of `max_new_tokens` tokens for every prompt (no early stop)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        lengths = [len(p) + max_new_tokens for p in prompts]
        pool, tables, packer = self._setup(lengths, sum(len(p) for p in prompts))
        prompt_lens = [len(p) for p in prompts]
        ids = list(range(len(prompts)))
        step = [ScheduledSequence(list(p), 0, t) for p, t in zip(prompts, tables)]
        outputs: list[list[int]] = [[] for _ in prompts]
        for _ in range(max_new_tokens):
            logits, pool = self._step(packer, pool, step, ids, prompt_lens, False)
            tokens = np.asarray(jnp.argmax(logits, axis=-1))
            for i, seq in enumerate(step):
                outputs[i].append(int(tokens[i]))
            step = [
                ScheduledSequence([int(tokens[i])], s.num_computed + len(s.token_ids), s.block_table)
                for i, s in enumerate(step)
            ]
        return outputs
