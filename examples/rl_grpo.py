"""A small GRPO loop: jaxpaged generates the rollouts, an optax trainer in the same process updates
the policy, and the engine serves the new weights at once (the trainer's arrays, no copy).

The policy is the demo model (4M parameters, King-James-flavoured English); the reward is how
often its completions say a target word (" LORD" by default), which it learns in a few minutes
on a CPU. Each iteration:

  1. rollouts: `group_size` completions of one prompt, sampled by the engine (temperature 1);
  2. rewards: the share of each completion's tokens that are the target word's token;
     advantages: each reward minus the group's mean, over the group's standard deviation (GRPO);
  3. one gradient step on `-mean(advantage x log p(completion token))`, the log-probabilities
     from `jaxpaged.functional.token_logprobs` (the engine's own model code) with the trainer's
     parameters: on-policy, so the importance ratio is 1 and needs no clipping;
  4. `llm.update_weights(params)`: the engine takes the trainer's arrays as they are.

With `--lora-rank R` the base model stays frozen and the trainer trains a LoRA adapter instead
(`llm.init_lora`: PEFT's initialisation, the base model at first); the log-probabilities come
from `token_logprobs(..., lora=adapter)` and `llm.update_lora("policy", adapter)` serves each new
version to the next rollouts, with no copy to the host and nothing compiled.

    python examples/rl_grpo.py --iterations 40 --plot reward.png
    python examples/rl_grpo.py --iterations 40 --lora-rank 8 --learning-rate 3e-3

Needs optax (`pip install "jaxpaged[rl]"`); the chart needs matplotlib.
"""

import argparse
import json
import time

import jax
import numpy as np
import optax

from jaxpaged import LLM, SamplingParams
from jaxpaged.functional import token_logprobs


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo", help="the policy (default: the demo model)")
    parser.add_argument("--prompt", default="And God said")
    parser.add_argument("--target-word", default=" LORD", help="the word the reward counts (one token)")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--group-size", type=int, default=16, help="completions per iteration (GRPO's group)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completion")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--lora-rank", type=int, default=0, help="train a LoRA adapter of this rank (0: every weight)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="save the reward curve to this image (needs matplotlib)")
    parser.add_argument("--json", default=None, help="write the reward per iteration to this JSON file")
    return parser.parse_args(argv)


def make_train_step(graphdef, optimizer, prompt_len: int, shardings, frozen=None):
    """One jitted GRPO step: `(trained, opt_state, sequences [G, P + T], advantages [G])` -> new
    trained arrays (with `shardings`, the engine's: so the engine takes them without a copy),
    optimizer state, loss. `trained` is the model's parameters, or with `frozen` (the base
    model's parameters) a LoRA adapter over them."""

    def loss_fn(trained, sequences, advantages):
        if frozen is None:
            logprobs = token_logprobs(graphdef, trained, sequences)
        else:
            logprobs = token_logprobs(graphdef, frozen, sequences, lora=trained)
        logprobs = logprobs[:, prompt_len - 1 :]  # the completions' [G, T]
        return -(advantages[:, None] * logprobs).mean()

    @jax.jit
    def train_step(trained, opt_state, sequences, advantages):
        loss, grads = jax.value_and_grad(loss_fn)(trained, sequences, advantages)
        updates, opt_state = optimizer.update(grads, opt_state, trained)
        trained = jax.lax.with_sharding_constraint(optax.apply_updates(trained, updates), shardings)
        return trained, opt_state, loss

    return train_step


def main(argv=None) -> list[float]:
    args = parse_args(argv)
    # Each token bucket up to max_num_batched_tokens is a program compiled at start: 256 tokens
    # hold a group's prompts in one step (a longer prompt's prefill is chunked); the default,
    # 2048, would compile three more programs that the default run never uses.
    lora = dict(enable_lora=True, max_lora_rank=args.lora_rank) if args.lora_rank else {}
    llm = LLM(
        args.model,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=args.group_size,
        max_num_batched_tokens=256,
        seed=args.seed,
        **lora,
    )
    tokenizer = llm.get_tokenizer()
    target = tokenizer.encode(args.target_word, add_special_tokens=False)
    if len(target) != 1:
        raise SystemExit(f"--target-word {args.target_word!r} is {len(target)} tokens; pick a word of one token")
    prompt = tokenizer.encode(args.prompt)
    optimizer = optax.adam(args.learning_rate)
    params = llm.get_params()  # the trainer starts from the engine's own arrays
    frozen, policy = None, None
    if args.lora_rank:  # the base model frozen; the adapter starts as a no-op (B zeros)
        frozen, params = params, llm.init_lora(args.lora_rank, seed=args.seed)
        policy = llm.update_lora("policy", params)
    opt_state = optimizer.init(params)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    train_step = make_train_step(llm.get_graphdef(), optimizer, len(prompt), shardings, frozen)
    curve = []
    for iteration in range(args.iterations):
        start = time.perf_counter()
        sampling = SamplingParams(
            n=args.group_size, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=args.seed + iteration
        )
        [out] = llm.generate({"prompt_token_ids": prompt}, sampling, use_tqdm=False, lora_request=policy)
        completions = [list(c.token_ids) for c in out.outputs]
        rewards = np.array([c.count(target[0]) / args.max_tokens for c in completions], np.float32)
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        sequences = np.array([prompt + c for c in completions], np.int32)
        params, opt_state, loss = train_step(params, opt_state, sequences, advantages)
        if args.lora_rank:
            policy = llm.update_lora("policy", params)  # the next rollouts run with this version
            size = sum(x.nbytes for x in jax.tree.leaves(params))
            update = f"adapter {policy.lora_name!r} (rank {args.lora_rank}, {size / 2**10:.0f} KiB) updated"
        else:
            stats = llm.update_weights(params)
            update = f"weights shared {stats.shared_bytes / 2**20:.1f} MiB, copied {stats.copied_bytes} B"
        curve.append(float(rewards.mean()))
        print(
            f"iteration {iteration:3d}  reward {rewards.mean():.3f}  loss {float(loss):+.4f}  {update}  "
            f"{time.perf_counter() - start:.2f} s  | {tokenizer.decode(completions[0])!r}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reward": curve, "args": vars(args)}, f, indent=1)
    if args.plot:
        plot(curve, args)
    return curve


def plot(curve: list[float], args: argparse.Namespace) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(curve, marker=".")
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"reward (share of {args.target_word.strip()!r} tokens)")
    ax.set_title(f"GRPO on {args.model}: {args.group_size} rollouts per iteration")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"reward curve: {args.plot}")


if __name__ == "__main__":
    main()
