"""`jaxpaged bench plot`: latency against throughput from saved `bench serve` results.

    jaxpaged bench plot results/serve_*.json --output latency_vs_throughput.png [--x output_throughput]

One panel per metric (TTFT, TPOT, ITL, E2EL): its median and its highest saved percentile
against request (or output-token) throughput, one point per result file (each file is one
request rate, written on its point), joined in the order of the offered rate (past saturation
the throughput falls back), one line per model. Needs matplotlib (the bench extra).
"""

import argparse
import importlib.util
import json
import os
import sys

from jaxpaged.bench.metrics import METRICS

X_AXES = {"request_throughput": "request throughput (req/s)", "output_throughput": "output throughput (tok/s)"}
TITLES = {
    "ttft": "time to first token",
    "tpot": "time per output token",
    "itl": "inter-token latency",
    "e2el": "end-to-end latency",
}


def add_plot_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `bench plot`."""
    parser.add_argument("results", nargs="+", metavar="RESULT.json", help="result files of bench serve --save-result")
    parser.add_argument("--output", default="latency_vs_throughput.png", metavar="FILE.png", help="the chart to write")
    parser.add_argument("--x", default="request_throughput", choices=tuple(X_AXES), help="the throughput on the x axis")


def load_results(paths: list[str]) -> list[dict]:
    """The result files, checked to be `bench serve` results (vLLM's keys).

    Raises:
      ValueError: a file that is not JSON or lacks the throughput keys, naming it.
    """
    results = []
    for path in paths:
        try:
            with open(path) as f:
                result = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not JSON ({err.msg})") from None
        if not isinstance(result, dict) or not all(k in result for k in X_AXES):
            raise ValueError(
                f"{path}: not a bench serve result (no {' / '.join(X_AXES)}); write one with --save-result"
            )
        results.append(result)
    return results


def highest_percentile(result: dict, metric: str) -> str | None:
    """The key of the highest percentile saved for `metric` (e.g. `p99_ttft_ms`), or None."""
    keys = [k for k in result if k.startswith("p") and k.endswith(f"_{metric}_ms")]
    return max(keys, key=lambda k: float(k[1 : -len(f"_{metric}_ms")]), default=None)


def run(args: argparse.Namespace) -> int:
    """`jaxpaged bench plot` with parsed arguments."""
    if importlib.util.find_spec("matplotlib") is None:
        print(
            "jaxpaged bench plot needs the bench extra (matplotlib missing): pip install 'jaxpaged[bench]'",
            file=sys.stderr,
        )
        return 1
    for path in args.results:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such file")
    results = load_results(args.results)
    metrics = [m for m in METRICS if any(f"median_{m}_ms" in r for r in results)]
    if not metrics:
        raise ValueError("the results hold no latency statistics (median_ttft_ms, ...)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(2, len(metrics))
    rows = -(-len(metrics) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(metrics) :]:
        ax.set_visible(False)
    by_model: dict[str, list[dict]] = {}
    for result in results:
        by_model.setdefault(str(result.get("model_id", "?")), []).append(result)
    for ax, metric in zip(axes.flat, metrics):
        for model, runs in by_model.items():
            runs = sorted((r for r in runs if f"median_{metric}_ms" in r), key=_offered_rate)  # the load, in order
            xs = [r[args.x] for r in runs]
            ax.plot(xs, [r[f"median_{metric}_ms"] for r in runs], "o-", label=f"{model} median")
            top = highest_percentile(runs[0], metric) if runs else None
            if top is not None:
                ax.plot(xs, [r.get(top, float("nan")) for r in runs], "s--", label=f"{model} {top.split('_')[0]}")
            for x, r in zip(xs, runs):
                ax.annotate(
                    f"{r.get('request_rate', '?')}/s",
                    (x, r[f"median_{metric}_ms"]),
                    fontsize=7,
                    textcoords="offset points",
                    xytext=(3, 3),
                )
        ax.set(title=TITLES[metric], xlabel=X_AXES[args.x], ylabel="ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.output, dpi=120)
    print(f"wrote {args.output} ({len(results)} results, {', '.join(metrics)})", file=sys.stderr)
    return 0


def _offered_rate(result: dict) -> float:
    return float(result.get("request_rate", "inf"))
