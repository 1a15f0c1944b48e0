"""`jaxpaged bench extraction`: the clinical-notes extraction workload, constrained and not.

    jaxpaged bench extraction --num-prompts 64                                   # demo model, CPU
    jaxpaged bench extraction --model llama-3.1-8b --load-format dummy --tokenizer DIR \\
        --prefix-len 900 --note-len 100,2000                                     # 8B shapes, GPU

Every request shares one prefix (instruction and few-shot examples) and adds a note of its own
(`extraction_data.py`); it asks for a JSON document following one schema of a dozen fields. The
same requests run in each configuration, each in a process of its own with its own timeout (a
slow or failing one costs only itself):

  json+prefix-cache              constrained to the schema, prefix caching on
  json+no-prefix-cache           constrained, every prompt computed in full
  json+host-tier                 constrained, prefix caching with a host tier of the KV cache
                                 (`--kv-offloading-size`, default 1 GiB; it matters when the
                                 device pool cannot keep what the requests share)
  free+prefix-cache              the same prompts unconstrained, prefix caching on
  free+no-prefix-cache           unconstrained, no prefix caching
  free+host-tier                 unconstrained, with the host tier
  json+prefix-cache+speculation  constrained, prefix caching, speculative decoding
                                 (`--speculative-config`, default n-gram with 4 tokens; the other
                                 configurations run without it): constrained rows compute the
                                 tokens their grammar forces, then check the n-gram proposals
                                 it allows
  free+prefix-cache+speculation  unconstrained, prefix caching, speculative decoding
  json+prefix-cache+overlapped   constrained, prefix caching, the constrained steps overlapped
                                 like the others (their forced runs cut in two steps); the
                                 engine reads each step before the next while grammars run:
                                 this measures what that gains

All requests are submitted at once (`LLM.generate`), so TTFT includes queueing behind
`--max-num-seqs`. Reports requests/s, output tokens/s, TTFT and TPOT (mean, p50, p99), engine
steps and the wall time per step (a constrained step computes its forced tokens too), how the
requests finished, the prefix-cache hit rate, and the fraction of outputs the schema accepts
(validated with `jsonschema`); then each constrained configuration's ratios to its unconstrained
twin, each speculating configuration's to its twin without speculation, and reading first's to
overlapping. (Every
constrained configuration computes the tokens its schema forces without a step each, with or
without speculation, where they come before the proposals and are not counted as proposals:
see `Scheduler._add_forced`.) Unconstrained requests ignore EOS and write
`--output-len` tokens, constrained ones stop when the document is complete: compare TPOT and
output tokens/s (per token), not requests/s.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from jaxpaged.bench import extraction_data
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR, engine_config

CONFIGS = (
    "json+prefix-cache",
    "json+no-prefix-cache",
    "json+host-tier",
    "free+prefix-cache",
    "free+no-prefix-cache",
    "free+host-tier",
    "json+prefix-cache+speculation",
    "free+prefix-cache+speculation",
    "json+prefix-cache+overlapped",
)
DEFAULT_HOST_GIB = 1.0
# The speculating configurations' `speculative_config` unless --speculative-config gives one.
DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4}


def add_extraction_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `bench extraction` beyond the engine's."""
    parser.add_argument("--num-prompts", type=int, default=64, metavar="N", help="requests (default: 64)")
    parser.add_argument(
        "--prefix-len",
        type=int,
        default=900,
        metavar="N",
        help="tokens of the shared instruction and examples (default: 900)",
    )
    parser.add_argument(
        "--note-len", default="100,2000", metavar="MIN,MAX", help="tokens of each note (default: 100,2000)"
    )
    parser.add_argument(
        "--output-len", type=int, default=512, metavar="N", help="max_tokens of each request (default: 512)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        metavar="LIST",
        help=f"comma-separated subset of {', '.join(CONFIGS)} (default: all)",
    )
    parser.add_argument(
        "--config-timeout", type=float, default=1800, metavar="SECONDS", help="each configuration's time limit"
    )
    parser.add_argument("--output-json", metavar="FILE", help="write the results here")


def check_flags(args: argparse.Namespace) -> tuple[int, int]:
    """The note length range; every flag checked before anything slow.

    Raises:
      ValueError: a bad flag, named.
    """
    try:
        low, high = (int(v) for v in args.note_len.split(","))
    except ValueError:
        raise ValueError(f"--note-len {args.note_len!r}: give MIN,MAX token counts, e.g. 100,2000") from None
    if not 1 <= low <= high:
        raise ValueError(f"--note-len {args.note_len}: need 1 <= MIN <= MAX")
    for flag, value in (("--num-prompts", args.num_prompts), ("--output-len", args.output_len)):
        if value < 1:
            raise ValueError(f"{flag} {value}: must be at least 1")
    if args.prefix_len < 0:
        raise ValueError(f"--prefix-len {args.prefix_len}: must be at least 0")
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        raise ValueError(f"--configs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    return low, high


def extraction_tokenizer(args: argparse.Namespace):
    """The tokenizer the run's prompts are drawn with: the model's, or --tokenizer's."""
    from transformers import AutoTokenizer

    from jaxpaged.bench.datasets import dataset_tokenizer_dir

    return AutoTokenizer.from_pretrained(dataset_tokenizer_dir(args.model or DEMO_MODEL_DIR, args.tokenizer))


def extraction_requests(args: argparse.Namespace, note_len: tuple[int, int], tokenizer) -> list[dict]:
    """The run's prompts (`{"prompt_token_ids": ...}`)."""
    ids = extraction_data.extraction_prompts(
        tokenizer, args.num_prompts, args.prefix_len, note_len, seed=args.seed or 0
    )
    return [{"prompt_token_ids": p} for p in ids]


def check_lengths(args: argparse.Namespace, context: int, note_len: tuple[int, int]) -> None:
    """Every request (its prompt and --output-len) fits --max-model-len or the model's `context`.

    Raises:
      ValueError: the longest does not, naming the flags that make it and the limit.
    """
    requests = extraction_requests(args, note_len, extraction_tokenizer(args))
    longest = max(len(p["prompt_token_ids"]) for p in requests) + args.output_len
    limit = args.max_model_len or context
    if longest > limit:
        what = f"--max-model-len {limit}" if args.max_model_len else f"the model's context of {limit} tokens"
        raise ValueError(
            f"the longest request needs {longest} tokens (--prefix-len {args.prefix_len}, a note of up to "
            f"{note_len[1]} tokens (--note-len) and the template, plus --output-len {args.output_len}), more than "
            f"{what}; lower those flags, or use a model with a longer context"
        )


def run(args: argparse.Namespace) -> int:
    """`jaxpaged bench extraction` with parsed arguments: each configuration in its own process."""
    note_len = check_flags(args)
    placeholder = {} if args.max_num_seqs is not None else dict(max_num_seqs=1)
    checked = engine_config(args, **placeholder)  # every engine flag checked before anything slow
    check_lengths(args, checked.model.max_context_len, note_len)
    settings = {k: v for k, v in vars(args).items() if not callable(v)}
    results: dict = {"args": settings, "runs": {}}
    failed = False
    with tempfile.TemporaryDirectory(prefix="jaxpaged-extraction-") as tmp:
        settings_file = os.path.join(tmp, "args.json")
        with open(settings_file, "w") as f:
            json.dump(settings, f)
        for config in args.configs.split(","):
            print(f"running {config} ...", file=sys.stderr, flush=True)
            out = os.path.join(tmp, f"{config}.json")
            command = [sys.executable, "-m", "jaxpaged.bench.extraction_run", settings_file, config, out]
            try:
                proc = subprocess.run(command, capture_output=True, text=True, timeout=args.config_timeout)
                if proc.returncode:
                    results["runs"][config] = {"error": proc.stderr[-3000:]}
                else:
                    with open(out) as f:
                        results["runs"][config] = json.load(f)
            except subprocess.TimeoutExpired:
                results["runs"][config] = {"error": f"took more than --config-timeout {args.config_timeout:g} s"}
            failed |= "error" in results["runs"][config]
            if "error" in results["runs"][config]:
                print(f"{config} failed: {results['runs'][config]['error'][-500:]}", file=sys.stderr)
            if args.output_json:  # after every configuration: a later failure loses nothing
                with open(args.output_json, "w") as f:
                    json.dump(results, f, indent=2)
    print(table(results["runs"]))
    return 1 if failed else 0


def summary(values: list[float]) -> dict:
    """Mean, median and 99th percentile (milliseconds from seconds)."""
    ms = sorted(1000 * v for v in values) or [float("nan")]
    return {
        "mean": statistics.fmean(ms),
        "p50": statistics.median(ms),
        "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
    }


def table(runs: dict) -> str:
    """The results as a markdown table, then the constrained / unconstrained ratios."""
    lines = [
        "| config | requests/s | output tok/s | TTFT mean ms | TTFT p99 ms | TPOT mean ms | valid | finished by stop"
        " | prefix-cache hits | steps | step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for config, r in runs.items():
        if "error" in r:
            lines.append(f"| {config} | failed | | | | | | | | | |")
            continue
        lines.append(
            f"| {config} | {r['requests_per_second']:.2f} | {r['output_tokens_per_second']:.1f} | "
            f"{r['ttft_ms']['mean']:.1f} | {r['ttft_ms']['p99']:.1f} | {r['tpot_ms']['mean']:.2f} | "
            f"{r['valid_fraction']:.0%} | {r['finish_reasons'].get('stop', 0)}/{r['num_requests']} | "
            f"{r['prefix_cache_hit_rate']:.0%} | {r['engine_steps']} | {r['step_ms']:.2f} |"
        )
    pairs = [(f"json+{cache}", f"free+{cache}") for cache in ("prefix-cache", "no-prefix-cache", "host-tier")]
    pairs += [(f"{kind}+prefix-cache+speculation", f"{kind}+prefix-cache") for kind in ("json", "free")]
    pairs.append(("json+prefix-cache", "json+prefix-cache+overlapped"))
    for ours_name, theirs_name in pairs:
        ours, theirs = runs.get(ours_name), runs.get(theirs_name)
        if ours and theirs and "error" not in ours and "error" not in theirs:
            lines.append(
                f"\n{ours_name} / {theirs_name}: TPOT {ours['tpot_ms']['mean'] / theirs['tpot_ms']['mean']:.2f}x, "
                f"TTFT {ours['ttft_ms']['mean'] / theirs['ttft_ms']['mean']:.2f}x, "
                f"step time {ours['step_ms'] / theirs['step_ms']:.2f}x, "
                f"output tokens/s {ours['output_tokens_per_second'] / theirs['output_tokens_per_second']:.2f}x"
            )
    return "\n".join(lines)
