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

Reports TTFT (mean, p50, p99) over the repeat visits (a prefix's second and later turns), over
all requests, and requests/s; the ratio of each TTFT to no-prefix-cache's.

    python benchmarks/kv_tiers.py [--model DIR] [--num-prefixes 8] [--num-prompts 48] [--json out.json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = ("no-prefix-cache", "device-cache", "small-pool", "small-pool+host")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded demo model)")
    parser.add_argument("--num-prefixes", type=int, default=8, help="distinct prefixes (default: 8)")
    parser.add_argument("--num-prompts", type=int, default=48, help="requests, one after another (default: 48)")
    parser.add_argument("--prefix-len", type=int, default=900, help="tokens of each prefix (default: 900)")
    parser.add_argument("--suffix-len", default="50,100", help="MIN,MAX tokens of each prompt's own suffix")
    parser.add_argument("--output-len", type=int, default=16, help="tokens generated per request (default: 16)")
    parser.add_argument("--host-gib", type=float, default=0.25, help="host tier size for small-pool+host (GiB)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds each configuration may take")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--config", choices=CONFIGS, help=argparse.SUPPRESS)  # one configuration, in its process
    return parser.parse_args(argv)


def requests(args):
    import random

    from jaxpaged.bench.datasets import prefix_requests

    low, high = (int(v) for v in args.suffix_len.split(","))
    return prefix_requests(random.Random(0), list(range(3, 4000)), args.num_prompts, args.prefix_len, (low, high),
                           args.output_len, 1024, args.num_prefixes)  # fmt: skip


def run_one(args) -> dict:
    """One configuration: start the engine, run the requests one by one, measure."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR

    reqs = requests(args)
    longest = max(r.prompt_len for r in reqs) + args.output_len
    blocks_per_request = -(-longest // 16)
    llm0 = dict(model=args.model or DEMO_MODEL_DIR, max_model_len=longest, max_num_seqs=1,
                max_num_batched_tokens=2048, block_size=16)  # fmt: skip
    pool_blocks = {"small-pool": 2 * blocks_per_request + 8, "small-pool+host": 2 * blocks_per_request + 8}
    pool_blocks = pool_blocks.get(args.config, (args.num_prefixes + 2) * blocks_per_request)
    from jaxpaged.config.model_config import ModelConfig, kv_bytes_per_token
    from jaxpaged.config.presets import load_config_dict
    from jaxpaged.model import kv_storage_dtype

    raw = load_config_dict(llm0["model"])[1]
    dtype = kv_storage_dtype(raw.get("dtype") or raw.get("torch_dtype") or "float32")
    per_block = kv_bytes_per_token(ModelConfig.from_hf(raw), dtype.itemsize) * 16
    extra = dict(kv_offloading_size=args.host_gib) if args.config == "small-pool+host" else {}
    llm = LLM(**llm0, enable_prefix_caching=args.config != "no-prefix-cache",
              kv_cache_memory_bytes=(pool_blocks + 1) * per_block, **extra)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": list(range(5, 60))}, params, use_tqdm=False)  # warm-up
    ttft, start = [], time.perf_counter()
    for r in reqs:
        out = llm.generate({"prompt_token_ids": r.prompt_token_ids}, params, use_tqdm=False)[0]
        ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
    elapsed = time.perf_counter() - start
    stats = llm.get_stats()
    repeat = ttft[args.num_prefixes :]
    return {
        "config": args.config, "pool_blocks": pool_blocks, "blocks_per_request": blocks_per_request,
        "elapsed_s": elapsed, "requests_per_second": len(reqs) / elapsed,
        "ttft_repeat_ms": summary(repeat), "ttft_all_ms": summary(ttft),
        "prefix_cache_hits": stats["prefix_cache_hits"], "prefix_cache_queries": stats["prefix_cache_queries"],
        "host_tier_hits": stats.get("external_prefix_cache_hits", 0), "kv_offload_bytes": stats.get("kv_offload_bytes", 0),
        "kv_load_bytes": stats.get("kv_load_bytes", 0),
    }  # fmt: skip


def summary(seconds: list[float]) -> dict:
    ms = sorted(1000 * s for s in seconds)
    return {"mean": statistics.fmean(ms), "p50": statistics.median(ms), "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))]}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.config:
        print(json.dumps(run_one(args)))
        return 0
    import jax

    results = {"device": str(jax.devices()[0].device_kind), "jax_version": jax.__version__, "args": vars(args), "runs": {}}
    for config in CONFIGS:
        command = [sys.executable, os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:]), "--config", config]
        print(f"running {config} ...", file=sys.stderr, flush=True)
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
    base = results["runs"]["no-prefix-cache"].get("ttft_repeat_ms", {}).get("mean")
    print(f"{'configuration':<18} {'TTFT repeat mean/p50/p99 ms':>30} {'vs no cache':>12} {'req/s':>7} {'host hits':>10}")
    for config, r in results["runs"].items():
        if "error" in r:
            print(f"{config:<18} failed: {r['error'][-300:]}")
            continue
        t = r["ttft_repeat_ms"]
        ratio = f"{t['mean'] / base:.2f}x" if base else "-"
        print(f"{config:<18} {t['mean']:10.1f} {t['p50']:9.1f} {t['p99']:9.1f} {ratio:>12} {r['requests_per_second']:7.2f} "
              f"{r['host_tier_hits']:10d}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
