"""The engine's step function inside your own JAX code: prefill with `jit`, decode with `lax.scan`.

`jaxpaged.functional.step` is pure: model state, cache and inputs in; cache and sampled tokens
out. Here one sequence is prefilled, then 32 tokens are decoded in a single jitted `lax.scan`
that builds each step's inputs on the device from the previous token: no host round trips.

    python examples/step_function.py [--model DIR] [--prompt TEXT]
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from transformers import AutoTokenizer

from jaxpaged.checkpoint.loader import load_model
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
from jaxpaged.functional import StepInput, init_cache, step
from jaxpaged.model import AttentionMetadata
from jaxpaged.model.sampler import SamplingTensors

BLOCK_SIZE = 16


def greedy_sampling(num_seqs: int, position) -> SamplingTensors:
    ones, zeros = jnp.ones(num_seqs, jnp.float32), jnp.zeros(num_seqs, jnp.int32)
    return SamplingTensors(
        temperature=0 * ones, top_k=zeros, top_p=ones, min_p=0 * ones, presence_penalty=0 * ones,
        frequency_penalty=0 * ones, repetition_penalty=ones, seed=zeros, index=zeros,
        position=jnp.broadcast_to(position, (num_seqs,)).astype(jnp.int32), slot=zeros, ban_until=zeros,
    )  # fmt: skip


def step_input(token_ids, positions, block_table, kv_len, vocab_size: int, reset: bool) -> StepInput:
    """Inputs for one sequence computing `token_ids` at `positions` (its pages in `block_table`)."""
    n = token_ids.shape[0]
    slots = block_table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
    return StepInput(
        token_ids=token_ids,
        metadata=AttentionMetadata(
            positions=positions, slot_mapping=slots, cu_q_lens=jnp.array([0, n], jnp.int32),
            kv_lens=jnp.reshape(kv_len, (1,)).astype(jnp.int32), block_tables=block_table[None],
            num_seqs=jnp.int32(1),
        ),  # fmt: skip
        logits_indices=jnp.array([n - 1], jnp.int32),
        sampling=greedy_sampling(1, kv_len),
        token_slot=jnp.zeros(n, jnp.int32),
        token_is_output=jnp.full(n, not reset),
        reset_slots=jnp.array([0 if reset else 1], jnp.int32),  # row 1 is out of range: no reset
        banned_ids=jnp.full((1, 1), vocab_size, jnp.int32),
        from_last=jnp.zeros(n, bool),  # every token given here (none read from cache.last_tokens)
        last_slot=jnp.zeros(1, jnp.int32),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEMO_MODEL_DIR)
    parser.add_argument("--prompt", default="In the beginning")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    config, model = load_model(args.model, dtype="float32")
    graphdef, params = nnx.split(model)
    prompt = jnp.asarray(tokenizer.encode(args.prompt), jnp.int32)
    total = prompt.shape[0] + args.new_tokens
    pages = -(-total // BLOCK_SIZE)
    cache = init_cache(config, num_blocks=pages + 1, block_size=BLOCK_SIZE, dtype=jnp.float32, max_num_seqs=1)
    block_table = jnp.arange(1, pages + 1, dtype=jnp.int32)  # block 0 is the null block

    jitted_step = jax.jit(step, static_argnums=0, donate_argnums=2)
    positions = jnp.arange(prompt.shape[0], dtype=jnp.int32)
    inp = step_input(prompt, positions, block_table, prompt.shape[0], config.vocab_size, reset=True)
    cache, first = jitted_step(graphdef, params, cache, inp)

    @jax.jit
    def decode(params, cache, token, position):
        def body(carry, _):
            cache, token, position = carry
            inp = step_input(token[None], position[None], block_table, position + 1, config.vocab_size, reset=False)
            cache, result = step(graphdef, params, cache, inp)
            return (cache, result.token_ids[0], position + 1), result.token_ids[0]

        (cache, _, _), tokens = jax.lax.scan(body, (cache, token, position), length=args.new_tokens - 1)
        return cache, tokens

    cache, rest = decode(params, cache, first.token_ids[0], jnp.int32(prompt.shape[0]))
    tokens = [int(first.token_ids[0])] + np.asarray(rest).tolist()
    print(args.prompt + tokenizer.decode(tokens, skip_special_tokens=True))


if __name__ == "__main__":
    main()
