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
from jaxpaged.functional import init_cache, make_step_input, step

BLOCK_SIZE = 16


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

    n = jnp.array([prompt.shape[0]])
    one_sequence = dict(
        prompt_lens=n,
        block_tables=block_table[None],
        block_size=BLOCK_SIZE,
        vocab_size=config.vocab_size,
        max_num_seqs=1,
    )
    jitted_step = jax.jit(step, static_argnums=0, donate_argnums=2)
    inp = make_step_input(prompt, query_lens=n, kv_lens=n, **one_sequence)  # the prompt, in one step
    cache, first = jitted_step(graphdef, params, cache, inp)

    @jax.jit
    def decode(params, cache, token, position):
        def body(carry, _):
            cache, token, position = carry
            inp = make_step_input(token[None], query_lens=jnp.ones(1), kv_lens=(position + 1)[None], **one_sequence)
            cache, result = step(graphdef, params, cache, inp)
            return (cache, result.token_ids[0], position + 1), result.token_ids[0]

        (cache, _, _), tokens = jax.lax.scan(body, (cache, token, position), length=args.new_tokens - 1)
        return cache, tokens

    cache, rest = decode(params, cache, first.token_ids[0], jnp.int32(prompt.shape[0]))
    tokens = [int(first.token_ids[0])] + np.asarray(rest).tolist()
    print(args.prompt + tokenizer.decode(tokens, skip_special_tokens=True))


if __name__ == "__main__":
    main()
