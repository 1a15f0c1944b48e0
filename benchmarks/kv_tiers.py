"""Time to first token with the KV cache's tiers: many long shared prefixes taking turns.

The clinical-notes case with several templates (`jaxpaged bench`'s prefix dataset with
`--num-prefixes`): K prefixes of `--prefix-len` tokens, each prompt one of them in turn plus its
own suffix. Requests run one after another (TTFT is then the prefill's cost, nothing queued).
Each configuration runs in a process of its own:

  no-prefix-cache   every prompt computed in full
  device-cache      a device pool that keeps every prefix: repeat visits hit on the device
  small-pool        a pool that keeps about two prefixes: each is evicted before its next turn
  small-pool+host   the same pool with a host tier (--kv-offloading-size): evicted prefixes
                    come back from host memory
  fresh+disk        that pool and host tier with a disk tier (--kv-cache-dir) that an earlier
                    engine process filled with the same requests: a fresh engine finds every
                    prefix on disk, even on its first visit

Reports TTFT (mean, p50, p99) over the repeat visits (a prefix's second and later turns), over
the first visits (what only the disk tier can serve), and requests/s; the ratio of each TTFT to
no-prefix-cache's.

    python -m benchmarks.kv_tiers [--model DIR] [--num-prefixes 8] [--num-prompts 48] [--json out.json]
    python -m benchmarks.kv_tiers --model llama-3.1-8b --load-format dummy \
        --configs no-prefix-cache,small-pool+host,fresh+disk                    # on a GPU, in one call
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time

CONFIGS = ("no-prefix-cache", "device-cache", "small-pool", "small-pool+host", "fresh+disk")
_WARM_DISK = "warm-disk"  # the earlier process of fresh+disk


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded demo model)")
    parser.add_argument(
        "--load-format",
        default="auto",
        choices=("auto", "dummy"),
        help="dummy: random weights of a preset's or config-only directory's shapes (no tokenizer)",
    )
    parser.add_argument("--num-prefixes", type=int, default=8, help="distinct prefixes (default: 8)")
    parser.add_argument("--num-prompts", type=int, default=48, help="requests, one after another (default: 48)")
    parser.add_argument("--prefix-len", type=int, default=900, help="tokens of each prefix (default: 900)")
    parser.add_argument("--suffix-len", default="50,100", help="MIN,MAX tokens of each prompt's own suffix")
    parser.add_argument("--output-len", type=int, default=16, help="tokens generated per request (default: 16)")
    parser.add_argument("--host-gib", type=float, default=0.25, help="host tier size for small-pool+host (GiB)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds each configuration may take")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)} (default: all)"
    )
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--config", choices=(*CONFIGS, _WARM_DISK), help=argparse.SUPPRESS)  # one, in its process
    parser.add_argument("--kv-cache-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"--configs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    return args


def requests(args, context: int):
    """The prompts; the process that fills the disk gets the same prefixes with other suffixes
    (only what the prefixes share may come from disk)."""
    import dataclasses
    import random

    from jaxpaged.bench.datasets import prefix_requests

    low, high = (int(v) for v in args.suffix_len.split(","))
    ids = list(range(3, 4000))
    reqs = prefix_requests(
        random.Random(0),
        ids,
        args.num_prompts,
        args.prefix_len,
        (low, high),
        args.output_len,
        context,
        args.num_prefixes,
    )
    if args.config == _WARM_DISK:
        other = random.Random(1)
        reqs = [
            dataclasses.replace(
                r,
                prompt_token_ids=r.prompt_token_ids[: args.prefix_len]
                + other.choices(ids, k=r.prompt_len - args.prefix_len),
            )
            for r in reqs
        ]
    return reqs


def run_one(args) -> dict:
    """One configuration: start the engine, run the requests one by one, measure."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.config.hf_config import model_config_from_hf
    from jaxpaged.config.model_config import kv_bytes_per_token
    from jaxpaged.config.presets import load_config_dict
    from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
    from jaxpaged.model import kv_storage_dtype

    raw = load_config_dict(args.model or DEMO_MODEL_DIR)[1]
    config = model_config_from_hf(raw)
    reqs = requests(args, config.max_context_len)
    longest = max(r.prompt_len for r in reqs) + args.output_len
    blocks_per_request = -(-longest // 16)
    llm0 = dict(
        model=args.model or DEMO_MODEL_DIR,
        max_model_len=longest,
        max_num_seqs=1,
        # one request at a time: no step holds more tokens than it (a larger token bucket would be
        # compiled and never run)
        max_num_batched_tokens=longest,
        block_size=16,
        load_format=args.load_format,
        skip_tokenizer_init=args.load_format == "dummy",
    )
    small = args.config in ("small-pool", "small-pool+host", "fresh+disk", _WARM_DISK)
    pool_blocks = 2 * blocks_per_request + 8 if small else (args.num_prefixes + 2) * blocks_per_request
    dtype = kv_storage_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    per_block = kv_bytes_per_token(config, dtype.itemsize) * 16
    extra = {}
    if args.config in ("small-pool+host", "fresh+disk", _WARM_DISK):
        extra["kv_offloading_size"] = args.host_gib
    if args.config in ("fresh+disk", _WARM_DISK):
        extra["kv_cache_dir"] = args.kv_cache_dir
    llm = LLM(
        **llm0,
        enable_prefix_caching=args.config != "no-prefix-cache",
        kv_cache_memory_bytes=(pool_blocks + 1) * per_block,
        **extra,
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": list(range(5, 60))}, params, use_tqdm=False)  # warm-up
    ttft, start = [], time.perf_counter()
    for r in reqs:
        out = llm.generate({"prompt_token_ids": r.prompt_token_ids}, params, use_tqdm=False)[0]
        ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
    elapsed = time.perf_counter() - start
    if llm.llm_engine.disk_tier is not None:
        llm.llm_engine.disk_tier.flush()
    stats = llm.get_stats()
    return {
        "config": args.config,
        "pool_blocks": pool_blocks,
        "blocks_per_request": blocks_per_request,
        "elapsed_s": elapsed,
        "requests_per_second": len(reqs) / elapsed,
        "ttft_repeat_ms": summary(ttft[args.num_prefixes :]),
        "ttft_first_visit_ms": summary(ttft[: args.num_prefixes]),
        "ttft_all_ms": summary(ttft),
        "disk_hit_tokens": stats.get("kv_disk_hit_tokens", 0),
        "disk_read_bytes": stats.get("kv_disk_read_bytes", 0),
        "disk_write_bytes": stats.get("kv_disk_write_bytes", 0),
        "prefix_cache_hits": stats["prefix_cache_hits"],
        "prefix_cache_queries": stats["prefix_cache_queries"],
        "host_tier_hits": stats.get("external_prefix_cache_hits", 0),
        "kv_offload_bytes": stats.get("kv_offload_bytes", 0),
        "kv_load_bytes": stats.get("kv_load_bytes", 0),
    }


def summary(seconds: list[float]) -> dict:
    ms = sorted(1000 * s for s in seconds)
    return {
        "mean": statistics.fmean(ms),
        "p50": statistics.median(ms),
        "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.config:
        print(json.dumps(run_one(args)))
        return 0
    import jax

    results = {
        "device": str(jax.devices()[0].device_kind),
        "jax_version": jax.__version__,
        "args": vars(args),
        "runs": {},
    }
    base_argv = ["-m", "benchmarks.kv_tiers", *(argv if argv is not None else sys.argv[1:])]
    with tempfile.TemporaryDirectory(prefix="jaxpaged-kv-dir-") as kv_dir:
        chosen = args.configs.split(",")
        order = [c for c in CONFIGS[:-1] if c in chosen] + ([_WARM_DISK, CONFIGS[-1]] if CONFIGS[-1] in chosen else [])
        for config in order:
            print(f"running {config} ...", file=sys.stderr, flush=True)
            command = [sys.executable, *base_argv, "--config", config, "--kv-cache-dir", kv_dir]
            try:
                proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                if proc.returncode:
                    results["runs"][config] = {"error": proc.stderr[-2000:]}
                else:
                    results["runs"][config] = json.loads(proc.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                results["runs"][config] = {"error": f"took more than {args.timeout} s"}
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(results, f, indent=2)
    print(table(results["runs"]))
    return 0


def table(runs: dict) -> str:
    """TTFT of repeat and first visits per configuration, with ratios to no-prefix-cache (if run)."""
    base = runs.get("no-prefix-cache", {}).get("ttft_repeat_ms", {}).get("mean")
    lines = [
        f"{'configuration':<16} {'TTFT repeat mean/p50/p99 ms':>28} {'vs none':>8} {'first visit mean ms':>20} "
        f"{'vs none':>8} {'req/s':>6}"
    ]
    for config, r in runs.items():
        if config == _WARM_DISK:
            continue
        if "error" in r:
            lines.append(f"{config:<16} failed: {r['error'][-300:]}")
            continue
        t, first = r["ttft_repeat_ms"], r["ttft_first_visit_ms"]
        base_first = runs.get("no-prefix-cache", {}).get("ttft_first_visit_ms", {}).get("mean")
        lines.append(
            f"{config:<16} {t['mean']:9.1f} {t['p50']:8.1f} {t['p99']:8.1f} "
            f"{t['mean'] / base if base else 0:7.2f}x {first['mean']:20.1f} "
            f"{first['mean'] / base_first if base_first else 0:7.2f}x {r['requests_per_second']:6.2f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
