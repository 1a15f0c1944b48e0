"""Serving-benchmark metrics with vLLM's definitions and result keys; no JAX, no HTTP.

Per request (client-side clock):
- TTFT: request sent -> first streamed chunk;
- ITL: the gaps between later chunks (one list per request);
- TPOT: (E2EL - TTFT) / (output tokens - 1), for requests of more than one token;
- E2EL: request sent -> last byte.
Goodput (DistServe): completed requests per second that meet every given SLO (`ttft:MS`,
`tpot:MS`, `e2el:MS`); a one-token request counts as TPOT 0 there.
"""

import dataclasses

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
DEFAULT_METRIC_PERCENTILES = "99"


@dataclasses.dataclass
class RequestResult:
    """What one request measured (seconds); `success` False carries `error`."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    generated_text: str = ""
    error: str = ""


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` (milliseconds) -> `{"ttft": 500.0, "tpot": 50.0}`.

    Raises:
      ValueError: a malformed pair, an unknown metric or a negative value, naming --goodput.
    """
    slos = {}
    for pair in pairs or []:
        name, _, value = pair.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: write METRIC:MILLISECONDS, e.g. ttft:500 tpot:50") from None
        if name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {pair!r}: the metric must be one of {', '.join(GOODPUT_METRICS)}")
        if not slos[name] >= 0:
            raise ValueError(f"--goodput {pair!r}: the milliseconds must be a non-negative number")
    return slos


def parse_percentile_metrics(text: str) -> list[str]:
    """`--percentile-metrics ttft,e2el` -> `["ttft", "e2el"]`, checked."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in METRICS]
    if unknown or not names:
        raise ValueError(f"--percentile-metrics {text!r}: choose from {', '.join(METRICS)} (comma-separated)")
    return names


def parse_metric_percentiles(text: str) -> list[float]:
    """`--metric-percentiles 50,90,99` -> `[50.0, 90.0, 99.0]`, each in [0, 100]."""
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(0 <= p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles {text!r}: give percentiles in [0, 100], comma-separated, e.g. 50,90,99")
    return values


def percentile_key(metric: str, p: float) -> str:
    """vLLM's result key of a percentile: `p99_ttft_ms`, `p99.9_itl_ms`."""
    return f"p{int(p) if p == int(p) else p}_{metric}_ms"


def tpot(r: RequestResult) -> float:
    """Seconds per output token after the first (0 for a one-token request)."""
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0


def summarize(
    results: list[RequestResult],
    duration: float,
    *,
    percentile_metrics: list[str],
    percentiles: list[float],
    goodput: dict[str, float],
) -> dict:
    """vLLM's serving-benchmark result dict: counts, throughputs, goodput, and for every metric
    in `percentile_metrics` its mean/median/std and each percentile in milliseconds, plus the
    per-request lists (`input_lens`, `output_lens`, `ttfts`, `itls`, `latencies`, `errors`, ...)."""
    done = [r for r in results if r.success]
    values = {
        "ttft": [r.ttft for r in done],
        "tpot": [tpot(r) for r in done if r.output_tokens > 1],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_tokens for r in done)
    good = sum(1 for r in done if all(_value(r, name) * 1000 <= slo for name, slo in goodput.items()))
    result = {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "percentile_metrics": ",".join(percentile_metrics),
        "metric_percentiles": ",".join(f"{p:g}" for p in percentiles),
        "goodput_slos_ms": goodput or None,
    }
    for metric in percentile_metrics:
        ms = np.asarray(values[metric] or [0.0]) * 1000
        result[f"mean_{metric}_ms"] = float(ms.mean())
        result[f"median_{metric}_ms"] = float(np.median(ms))
        result[f"std_{metric}_ms"] = float(ms.std())
        for p in percentiles:
            result[percentile_key(metric, p)] = float(np.percentile(ms, p))
    result.update(
        {
            "input_lens": [r.prompt_len for r in results],
            "output_lens": [r.output_tokens for r in results],
            "ttfts": [r.ttft for r in results],
            "itls": [r.itl for r in results],
            "latencies": [r.latency for r in results],
            "start_times": [r.start_time for r in results],
            "generated_texts": [r.generated_text for r in results],
            "errors": [r.error for r in results],
        }
    )
    return result


def _value(r: RequestResult, metric: str) -> float:
    return {"ttft": r.ttft, "tpot": tpot(r), "e2el": r.latency}[metric]
