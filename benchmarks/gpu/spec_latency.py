"""Greedy decoding latency of one engine on repetitive prompts, with or without speculation.

    python -m benchmarks.gpu.spec_latency --model llama-3.1-8b --load-format dummy --dtype bfloat16 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' \\
        --batch-sizes 1,8 --input-len 512 --phrase-len 32 --output-len 256 --output-json out.json

Every prompt is a random phrase of `--phrase-len` token ids repeated to `--input-len` tokens (the
repetition an n-gram lookup finds); each prompt of each iteration has a phrase of its own, drawn
from `--prompt-seed`, so engines given the same flags see the same prompts. Per batch size:
`--num-iters-warmup` untimed batches, then `--num-iters` timed ones, each timed twice: once with
`max_tokens=1` (the prefill) and once with `--output-len` tokens (greedy, EOS ignored); prefix
caching is off, so both prefill the whole prompt. Reports

- `tpot_ms`: (full - prefill-only latency) / (output_len - 1), the decode's time per token;
- `e2e_tpot_ms`: full latency / output_len (`jaxpaged bench latency`'s definition);
- `output_tok_s`: batch x output_len / full latency;
- the speculation counters over the timed full runs (`get_stats()`: proposed and accepted
  tokens, acceptance, accepted tokens per position) where speculation is on;
- the first timed iteration's output token ids (to compare engines: greedy speculation should
  give plain decoding's tokens) and the fraction of distinct tokens in each output (a random
  model decoding greedily often repeats itself, which an n-gram lookup exploits).

The JSON is rewritten after every batch size, so a timeout keeps the batches that finished.
"""

import argparse
import dataclasses
import json
import os
import random
import sys
import time

STARTED = time.perf_counter()

from jaxpaged.checkpoint.format import has_tokenizer  # noqa: E402
from jaxpaged.config.presets import load_config_dict  # noqa: E402
from jaxpaged.entrypoints.cli_flags import add_engine_flags, engine_args  # noqa: E402

SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
PER_POSITION = "spec_decode_num_accepted_tokens_per_pos"


def repetitive_prompts(vocab_size: int, count: int, input_len: int, phrase_len: int, seed: str) -> list[dict]:
    """`count` prompts, each a random phrase of `phrase_len` ids (from 1: no id 0) repeated to `input_len`."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(1, vocab_size) for _ in range(phrase_len)]
        prompts.append({"prompt_token_ids": (phrase * (input_len // phrase_len + 1))[:input_len]})
    return prompts


def spec_counters(llm) -> dict:
    stats = llm.get_stats()
    out = {name: stats[name] for name in SPEC_COUNTERS if name in stats}
    if PER_POSITION in stats:
        out[PER_POSITION] = list(stats[PER_POSITION])
    return out


def spec_delta(before: dict, after: dict) -> dict:
    """The counters' growth ({} without speculation)."""
    if not after:
        return {}
    delta = {name: after[name] - before.get(name, 0) for name in SPEC_COUNTERS}
    per_pos = after.get(PER_POSITION, [])
    delta[PER_POSITION] = [a - b for a, b in zip(per_pos, before.get(PER_POSITION) or [0] * len(per_pos))]
    return delta


def sum_deltas(deltas: list[dict]) -> dict:
    """Proposed and accepted tokens over several runs, with the acceptance rate (accepted /
    proposed) and the mean accepted tokens per proposal."""
    drafts, proposed, accepted = (sum(d[name] for d in deltas) for name in SPEC_COUNTERS)
    per_pos = [sum(column) for column in zip(*(d[PER_POSITION] for d in deltas))]
    return {
        "drafts": drafts,
        "draft_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "accepted_per_draft": accepted / drafts if drafts else None,
        "accepted_per_position": per_pos,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)
    parser.add_argument("--batch-sizes", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8])
    parser.add_argument("--input-len", type=int, default=512, help="prompt tokens")
    parser.add_argument("--phrase-len", type=int, default=32, help="tokens of the phrase each prompt repeats")
    parser.add_argument("--output-len", type=int, default=256, help="tokens generated per prompt")
    parser.add_argument("--num-iters-warmup", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=3)
    parser.add_argument("--prompt-seed", type=int, default=0)
    parser.add_argument("--label", default="", help="a name for the result")
    parser.add_argument("--output-json", metavar="FILE")
    args = parser.parse_args(argv)
    if args.output_len < 2 or args.num_iters < 1 or min(args.batch_sizes) < 1 or args.phrase_len < 1:
        parser.error("--output-len must be at least 2, --num-iters and --batch-sizes and --phrase-len at least 1")
    skip = args.skip_tokenizer_init or not (os.path.isdir(args.model or "") and has_tokenizer(args.model))
    # Prefix caching off: the full run must prefill what the prefill-only run of the same prompts did.
    engine = engine_args(args, skip_tokenizer_init=skip, enable_prefix_caching=False)
    vocab_size = load_config_dict(engine.model)[1]["vocab_size"]

    import jax

    from jaxpaged.entrypoints.llm import LLM
    from jaxpaged.sampling_params import SamplingParams

    imported = time.perf_counter()
    print(f"imports {imported - STARTED:.1f} s; jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    llm = LLM(**dataclasses.asdict(engine))
    ready = time.perf_counter()
    print(f"engine ready after {ready - imported:.1f} s", flush=True)
    spec = engine.speculative_config
    result = {
        "label": args.label,
        "model": engine.model,
        "dtype": engine.dtype,
        "load_format": engine.load_format,
        "speculative_config": dataclasses.asdict(spec) if spec else None,
        "device": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "input_len": args.input_len,
        "phrase_len": args.phrase_len,
        "output_len": args.output_len,
        "num_iters_warmup": args.num_iters_warmup,
        "num_iters": args.num_iters,
        "import_s": round(imported - STARTED, 2),
        "ready_s": round(ready - imported, 2),
        "batches": {},
    }

    def timed(prompts: list[dict], max_tokens: int) -> tuple[float, list]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs)
        return seconds, [list(o.outputs[0].token_ids) for o in outputs]

    for batch in args.batch_sizes:

        def prompts(i: int) -> list[dict]:
            return repetitive_prompts(
                vocab_size, batch, args.input_len, args.phrase_len, f"{args.prompt_seed}-{batch}-{i}"
            )

        for i in range(args.num_iters_warmup):
            timed(prompts(-1 - i), args.output_len)
        prefill, full, first_tokens, deltas = [], [], None, []
        for i in range(args.num_iters):
            seconds, _ = timed(prompts(i), 1)
            prefill.append(seconds)
            before = spec_counters(llm)
            seconds, tokens = timed(prompts(i), args.output_len)
            full.append(seconds)
            deltas.append(spec_delta(before, spec_counters(llm)))
            first_tokens = first_tokens if first_tokens is not None else tokens
        avg_full, avg_prefill = sum(full) / len(full), sum(prefill) / len(prefill)
        row = {
            "batch_size": batch,
            "latency_s": full,
            "prefill_s": prefill,
            "avg_latency_s": avg_full,
            "avg_prefill_s": avg_prefill,
            "tpot_ms": (avg_full - avg_prefill) / (args.output_len - 1) * 1000,
            "e2e_tpot_ms": avg_full / args.output_len * 1000,
            "output_tok_s": batch * args.output_len / avg_full,
            "distinct_output_token_frac": [len(set(t)) / len(t) for t in first_tokens],
            "token_ids": first_tokens,
        }
        if any(deltas):
            row["spec"] = sum_deltas(deltas)
        result["batches"][str(batch)] = row
        acceptance = row.get("spec", {}).get("acceptance_rate")
        print(
            f"batch {batch}: TPOT {row['tpot_ms']:.2f} ms (e2e {row['e2e_tpot_ms']:.2f} ms), "
            f"{row['output_tok_s']:.1f} output tok/s, prefill {avg_prefill * 1000:.1f} ms"
            + (f", acceptance {acceptance:.1%}" if acceptance is not None else ""),
            flush=True,
        )
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
