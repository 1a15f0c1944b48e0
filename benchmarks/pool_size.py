"""Per-token time against KV pool size: a step must cost the same whatever the pool holds.

Builds the demo model (or `--model`) with a small and a large KV pool in the same process and
times one greedy request per pool, with one decode step per program and with fused steps.
Prints ms per output token and the large/small ratio (goal: <= 1.2).

    python -m benchmarks.pool_size [--pools-mib 8 512] [--dtype auto] [--json out.json]
"""

import argparse
import json
import statistics
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded demo model)")
    parser.add_argument("--dtype", default="auto", help="model dtype (default: auto, the checkpoint's)")
    parser.add_argument(
        "--pools-mib",
        type=int,
        nargs=2,
        default=[8, 512],
        metavar=("SMALL", "LARGE"),
        help="the two KV pool sizes in MiB (default: 8 512)",
    )
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per timed request (default: 128)")
    parser.add_argument(
        "--repeats", type=int, default=9, help="timed requests per pool, alternating; the median is kept"
    )
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.pools_mib[0] <= 0 or args.pools_mib[1] <= 0:
        parser.error(f"--pools-mib {args.pools_mib}: sizes must be positive")
    return args


def time_per_token(llm, prompt: list[int], output_len: int) -> float:
    """Seconds per output token of one greedy request."""
    from jaxpaged import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    return (time.perf_counter() - start) / output_len


def main(argv=None) -> dict:
    args = parse_args(argv)
    from jaxpaged import LLM
    from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR

    model = args.model or DEMO_MODEL_DIR
    prompt = list(range(2, 34))  # 32 tokens
    rows = []
    for steps in (1, 4):
        engines = {
            mib: LLM(
                model,
                dtype=args.dtype,
                kv_cache_memory_bytes=mib << 20,
                max_num_seqs=1,
                max_num_batched_tokens=32,
                max_model_len=len(prompt) + args.output_len,
                num_scheduler_steps=steps,
                skip_tokenizer_init=True,
            )
            for mib in args.pools_mib
        }
        times: dict[int, list[float]] = {mib: [] for mib in args.pools_mib}
        for mib, llm in engines.items():  # warm-up
            time_per_token(llm, prompt, args.output_len)
        for _ in range(args.repeats):  # alternate, so drifting machine load hits both alike
            for mib, llm in engines.items():
                times[mib].append(time_per_token(llm, prompt, args.output_len))
        row = {"num_scheduler_steps": steps}
        for mib, llm in engines.items():
            row[f"pool_{mib}mib_tokens"] = llm.llm_engine.plan.num_tokens
            row[f"pool_{mib}mib_ms_per_token"] = 1e3 * statistics.median(times[mib])
        del engines
        small, large = (row[f"pool_{m}mib_ms_per_token"] for m in args.pools_mib)
        row["ratio"] = large / small
        rows.append(row)
        print(
            f"num_scheduler_steps={steps}: {small:.2f} ms/token with {args.pools_mib[0]} MiB, "
            f"{large:.2f} ms/token with {args.pools_mib[1]} MiB: ratio {row['ratio']:.2f}",
            flush=True,
        )
    import jax

    result = {
        "model": model,
        "dtype": args.dtype,
        "pools_mib": args.pools_mib,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
