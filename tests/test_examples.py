"""The examples run: the step function inside user JAX code (jit prefill, lax.scan decode)."""

import os
import subprocess
import sys

from engine_fixtures import hf_greedy, make_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_step_function_example_decodes_like_transformers(tmp_path):
    hf_model = make_model_dir(str(tmp_path))
    script = os.path.join(ROOT, "examples", "step_function.py")
    out = subprocess.run(
        [sys.executable, script, "--model", str(tmp_path), "--prompt", "the quick brown fox", "--new-tokens", "12"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    ).stdout
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = tokenizer.encode("the quick brown fox")
    expected = "the quick brown fox" + tokenizer.decode(hf_greedy(hf_model, prompt, 12), skip_special_tokens=True)
    assert out.rstrip("\n") == expected


def test_make_step_input_runs_a_ragged_batch_like_transformers(tmp_path):
    """Three sequences of different lengths prefilled in one padded step (one in two chunks, the
    second step also decoding the others), then decoded together: each gets transformers' greedy
    tokens. Blocks are interleaved and padding rows and tokens are present in every step."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxpaged.checkpoint.loader import load_model
    from jaxpaged.functional import init_cache, make_step_input, step

    hf_model = make_model_dir(str(tmp_path))
    config, model = load_model(str(tmp_path), dtype="float32")
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (5, 21, 12)]
    new_tokens, block_size, num_seqs = 6, 4, 4  # S = 4: one padding row
    tables = np.zeros((num_seqs, 8), np.int32)
    tables[:3] = 1 + np.arange(24).reshape(8, 3).T  # sequence s owns blocks s + 1, s + 4, ...: interleaved
    cache = init_cache(config, num_blocks=25, block_size=block_size, dtype=jnp.float32, max_num_seqs=num_seqs)
    common = dict(
        prompt_lens=jnp.array([5, 21, 12, 0]),
        block_tables=jnp.asarray(tables),
        block_size=block_size,
        vocab_size=config.vocab_size,
        max_num_seqs=num_seqs,
    )
    run = jax.jit(step, static_argnums=0)

    def pad(tokens, length):
        return jnp.asarray(tokens + [0] * (length - len(tokens)), jnp.int32)

    # step 1: prompts 0 and 2 whole, prompt 1's first 10 tokens (its sample is discarded)
    inp = make_step_input(
        pad(prompts[0] + prompts[1][:10] + prompts[2], 32),
        query_lens=jnp.array([5, 10, 12, 0]),
        kv_lens=jnp.array([5, 10, 12, 0]),
        **common,
    )
    cache, result = run(graphdef, params, cache, inp)
    outputs = [[int(result.token_ids[0])], [], [int(result.token_ids[2])]]
    # step 2: prompt 1's other 11 tokens, beside one decode token of each of the others
    inp = make_step_input(
        pad([outputs[0][0]] + prompts[1][10:] + [outputs[2][0]], 16),
        query_lens=jnp.array([1, 11, 1, 0]),
        kv_lens=jnp.array([6, 21, 13, 0]),
        **common,
    )
    cache, result = run(graphdef, params, cache, inp)
    for s in range(3):
        outputs[s].append(int(result.token_ids[s]))
    while len(outputs[1]) < new_tokens:  # decode all three together
        kv_lens = [len(p) + len(o) for p, o in zip(prompts, outputs)]
        inp = make_step_input(
            pad([o[-1] for o in outputs], 8),
            query_lens=jnp.array([1, 1, 1, 0]),
            kv_lens=jnp.array(kv_lens + [0]),
            **common,
        )
        cache, result = run(graphdef, params, cache, inp)
        for s in range(3):
            outputs[s].append(int(result.token_ids[s]))
    for prompt, output in zip(prompts, outputs):
        assert output[:new_tokens] == hf_greedy(hf_model, prompt, new_tokens)


def run_grpo(tmp_path, *args: str) -> tuple[list[float], str]:
    """examples/rl_grpo.py with `args` on the CPU: its reward per iteration and its output."""
    import json

    curve_file = tmp_path / "curve.json"
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "rl_grpo.py"), *args, "--json", str(curve_file)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    ).stdout
    return json.loads(curve_file.read_text())["reward"], out


def test_rl_grpo_example_trains_with_shared_weights(tmp_path):
    """A few GRPO iterations: the reward rises and every update takes the trainer's arrays (no
    copy)."""
    curve, out = run_grpo(tmp_path, "--iterations", "4")
    assert len(curve) == 4 and curve[-1] > curve[0], curve
    assert out.count("copied 0 B") == 4, out


def test_rl_grpo_example_trains_a_lora_adapter(tmp_path):
    """`--lora-rank`: GRPO trains a LoRA adapter over the frozen base model, and the engine
    serves each version (`update_lora`) to the next rollouts: the reward rises."""
    curve, out = run_grpo(tmp_path, "--iterations", "6", "--lora-rank", "8", "--learning-rate", "1e-2")
    assert len(curve) == 6 and curve[-1] > 4 * curve[0], curve
    assert out.count("adapter 'policy' (rank 8") == 6, out
