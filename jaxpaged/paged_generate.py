"""A simple batch generation loop through the paged KV pool.

This is the foundation's generation path (the continuous-batching engine replaces it): all
prompts are prefilled together in one ragged step, then decoded together one token per step.
Every step writes K/V into pool blocks given by each sequence's block table and attends by
reading them back, exactly as the engine's steps do.
"""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.model import AttentionMetadata, KVPool, Llama, init_kv_pool
from jaxpaged.step_inputs import PackedStep, ScheduledSequence, bucket, pack_step


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("kv_pool",))
def _forward(graphdef, state, kv_pool: KVPool, packed: dict, logits_rows):
    """Runs the model over one packed step; returns float32 logits at `logits_rows` and the pool."""
    model = nnx.merge(graphdef, state)
    meta = AttentionMetadata(
        positions=packed["positions"],
        slot_mapping=packed["slot_mapping"],
        cu_q_lens=packed["cu_q_lens"],
        kv_lens=packed["kv_lens"],
        block_tables=packed["block_tables"],
        num_seqs=packed["num_seqs"],
    )
    hidden, kv_pool = model(packed["token_ids"], kv_pool, meta)
    return model.compute_logits(hidden[logits_rows]), kv_pool


@functools.partial(jax.jit, static_argnames=("top_k",))
def _sample(logits, key, temperature, top_k: int):
    """Greedy when temperature == 0, else softmax sampling at `temperature` over the top k."""
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6), axis=-1)
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


class PagedGenerator:
    """Generates continuations for a batch of prompts through a paged KV pool.

    Args:
      model: the NNX model (split once here; steps are plain jitted functions of its state).
      block_size: tokens per pool block.
      block_shuffle_seed: when set, sequences get pool blocks in a random order (tests use
        this to prove nothing relies on contiguous blocks); otherwise blocks 1, 2, 3, ...
    """

    def __init__(self, model: Llama, *, block_size: int = 16, block_shuffle_seed: int | None = None):
        self.config = model.config
        self.dtype = model.embed[...].dtype
        self.graphdef, self.state = nnx.split(model)
        self.block_size = block_size
        self.block_shuffle_seed = block_shuffle_seed

    def _allocate(self, lengths: Sequence[int]) -> tuple[KVPool, list[list[int]]]:
        """A fresh pool and one block table per sequence able to hold `lengths` tokens."""
        pages = [-(-n // self.block_size) for n in lengths]
        block_ids = np.arange(1, sum(pages) + 1)  # block 0 is the null block
        if self.block_shuffle_seed is not None:
            np.random.default_rng(self.block_shuffle_seed).shuffle(block_ids)
        tables, start = [], 0
        for p in pages:
            tables.append(block_ids[start : start + p].tolist())
            start += p
        pool = init_kv_pool(self.config, sum(pages) + 1, self.block_size, self.dtype)
        return pool, tables

    def _run(self, pool: KVPool, packed: PackedStep, logits_rows: np.ndarray):
        arrays = {name: jnp.asarray(value) for name, value in vars(packed).items()}
        return _forward(self.graphdef, self.state, pool, arrays, jnp.asarray(logits_rows))

    def prompt_logits(self, prompt: list[int], chunk_size: int | None = None) -> np.ndarray:
        """Float32 logits `[len(prompt), V]` of every prompt position, prefilled through the pool
        in chunks of `chunk_size` tokens (one chunk when None)."""
        chunk_size = chunk_size or len(prompt)
        pool, (table,) = self._allocate([len(prompt)])
        pages = len(table)
        rows = []
        for start in range(0, len(prompt), chunk_size):
            chunk = prompt[start : start + chunk_size]
            num_tokens = bucket(len(chunk))
            packed = pack_step(
                [ScheduledSequence(chunk, start, table)],
                block_size=self.block_size, num_tokens=num_tokens, num_seqs=1, pages_per_seq=pages,
            )
            logits, pool = self._run(pool, packed, np.arange(num_tokens))
            rows.append(np.asarray(logits)[: len(chunk)])
        return np.concatenate(rows)

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
    ) -> list[list[int]]:
        """Generates up to `max_new_tokens` tokens per prompt; a sequence stops early at a stop token
        (which is included in its output).

        Returns:
          The generated token ids of each prompt, in order.
        """
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        lengths = [len(p) + max_new_tokens for p in prompts]
        pool, tables = self._allocate(lengths)
        num_seqs, pages = bucket(len(prompts), 1), max(len(t) for t in tables)
        outputs: list[list[int]] = [[] for _ in prompts]
        key = jax.random.key(seed)
        stop = set(stop_token_ids)

        # Prefill every prompt in one ragged step, then decode the live sequences together.
        step = [ScheduledSequence(list(p), 0, t) for p, t in zip(prompts, tables)]
        live = list(range(len(prompts)))
        for step_index in range(max_new_tokens):
            packed = pack_step(
                step, block_size=self.block_size, num_tokens=bucket(sum(len(s.token_ids) for s in step)),
                num_seqs=num_seqs, pages_per_seq=pages,
            )
            logits, pool = self._run(pool, packed, packed.last_token_index)
            step_key = jax.random.fold_in(key, step_index)
            tokens = np.asarray(_sample(logits, step_key, jnp.float32(temperature), top_k))
            next_step, next_live = [], []
            for row, i in enumerate(live):
                token = int(tokens[row])
                outputs[i].append(token)
                if token in stop or len(outputs[i]) == max_new_tokens:
                    continue
                done = step[row].num_computed + len(step[row].token_ids)
                next_step.append(ScheduledSequence([token], done, tables[i]))
                next_live.append(i)
            step, live = next_step, next_live
            if not live:
                break
        return outputs
