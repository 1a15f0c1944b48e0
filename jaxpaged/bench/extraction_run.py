"""One configuration of `jaxpaged bench extraction`, in a process of its own:

    python -m jaxpaged.bench.extraction_run ARGS.json CONFIG OUT.json

ARGS.json holds the parsed flags of `bench extraction`; the result dict is written to OUT.json.
"""

import argparse
import collections
import dataclasses
import json
import random
import sys
import time

from jaxpaged.bench import extraction, extraction_data
from jaxpaged.core.speculation import SPEC_DECODE_COUNTERS
from jaxpaged.entrypoints.cli_flags import engine_args, engine_config
from jaxpaged.entrypoints.cli_generate import size_to_job
from jaxpaged.sampling_params import SamplingParams, StructuredOutputsParams


def config_modes(config: str) -> tuple[bool, str, bool, bool]:
    """A configuration's name read: (constrained, cache, speculation, overlapped)."""
    constrained, cache, *extras = config.split("+")
    return constrained == "json", cache, "speculation" in extras, "overlapped" in extras


def run_config(args: argparse.Namespace, config: str) -> dict:
    """Starts the engine `config` describes, runs every request at once, measures."""
    note_len = extraction.check_flags(args)
    constrained, cache, speculation, overlapped = config_modes(config)
    tokenizer = extraction.extraction_tokenizer(args)
    prompts = extraction.extraction_requests(args, note_len, tokenizer)
    structured = StructuredOutputsParams(json=extraction_data.SCHEMA) if constrained else None
    # Unconstrained requests ignore EOS and write --output-len tokens (as vLLM's benchmarks do):
    # a toy or random-weight model would otherwise stop after a few tokens, and what the two modes
    # should compare is the cost of a token, not how soon a model gives up.
    params = SamplingParams(
        temperature=args.temperature,
        max_tokens=args.output_len,
        structured_outputs=structured,
        ignore_eos=structured is None,
    )
    overrides = dict(
        enable_prefix_caching=cache != "no-prefix-cache",
        kv_offloading_size=(args.kv_offloading_size or extraction.DEFAULT_HOST_GIB) if cache == "host-tier" else None,
        speculative_config=(args.speculative_config or extraction.DEFAULT_SPECULATIVE_CONFIG) if speculation else None,
    )
    placeholder = {} if args.max_num_seqs is not None else dict(max_num_seqs=1)
    checked = engine_config(args, **overrides, **placeholder)
    sizes = size_to_job(args, checked.model, prompts, [params] * len(prompts))
    options = engine_args(args, **sizes, **overrides)

    from jaxpaged.entrypoints.llm import LLM  # JAX is imported from here on

    llm = LLM(**dataclasses.asdict(options))
    llm.llm_engine.runner.read_first_under_grammars = not overlapped
    # Warm-up: one request that shares nothing with the timed ones (no prefix hit), with the same
    # constraint (its grammar is compiled and cached here, as on a server that has seen the schema).
    rng = random.Random(1)
    warm = {"prompt_token_ids": [rng.randrange(10, tokenizer.vocab_size) for _ in range(32)]}
    llm.generate(warm, dataclasses.replace(params, max_tokens=8), use_tqdm=False)
    before = llm.get_stats()
    steps = count_steps(llm.llm_engine.runner)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.get_stats()
    ttft, tpot, out_tokens = [], [], 0
    for out in outputs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        out_tokens += n
        ttft.append(m.first_token_time - m.arrival_time)
        if n > 1:
            tpot.append((m.finished_time - m.first_token_time) / (n - 1))
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    spec = {k: after[k] - before[k] for k in SPEC_DECODE_COUNTERS if k in after}
    return {
        "config": config,
        "engine_sizes": sizes,
        "num_requests": len(outputs),
        "elapsed_s": elapsed,
        "requests_per_second": len(outputs) / elapsed,
        "output_tokens_per_second": out_tokens / elapsed,
        "total_output_tokens": out_tokens,
        "engine_steps": len(steps),  # model programs dispatched (a fused window is one)
        "step_ms": 1000 * elapsed / max(1, len(steps)),  # wall time per engine step
        "total_prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
        "ttft_ms": extraction.summary(ttft),
        "tpot_ms": extraction.summary(tpot),
        "finish_reasons": dict(collections.Counter(o.outputs[0].finish_reason for o in outputs)),
        "valid_fraction": sum(extraction_data.is_valid(o.outputs[0].text) for o in outputs) / len(outputs),
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "speculation": spec,  # proposal windows, proposed and accepted tokens (empty without)
    }


def count_steps(runner) -> list[int]:
    """Records each step `runner` computes from now on (its fused decode steps: 1 unless fused);
    returns the list it appends to."""
    steps: list[int] = []
    execute = runner.execute

    def counted(output):
        if not output.is_empty:
            steps.append(output.num_steps)
        return execute(output)

    runner.execute = counted
    return steps


def main(argv: list[str] | None = None) -> int:
    settings_file, config, out = argv if argv is not None else sys.argv[1:]
    with open(settings_file) as f:
        args = argparse.Namespace(**json.load(f))
    result = run_config(args, config)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
