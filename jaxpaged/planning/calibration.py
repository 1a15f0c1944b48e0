"""The throughput model against every GPU measurement committed (benchmarks/results/), no JAX.

Each `Measurement` is one figure of one run, copied here with the file and key it comes from
(tests/test_plan_throughput.py checks the copies against the files, so this works without a
checkout) and the error the model is held to (`bound`, relative). Each `Case` replays that run's
engine and requests: Llama-3.1-8B's shapes, bf16, `--max-model-len 2048 --max-num-seqs 256
--max-num-batched-tokens 2048`, 4 fused decode steps, on the H100. The serving runs predate
2026-12-02, when streamed requests stopped fusing decode steps: they are replayed fused.

Not modelled: `latency_scanned.json` (`--scan-layers`: the scan copies every layer's weights per
step, 2.55x; the model prices the unrolled engine only); the kernel timings of `kernels.json` and
`kv_transfer.json` are the model's inputs, not its outputs.
"""

import dataclasses
import json
import os

from jaxpaged.planning.buckets import BucketFactory
from jaxpaged.planning.step_cost import Levers, StepCosts
from jaxpaged.planning.throughput import MEDIAN_LATENCY_BOUND, THROUGHPUT_BOUND, TTFT_BOUND, ThroughputQuery, predict
from jaxpaged.planning.workloads import Workload, lengths_workload, random_workload

RUN = "benchmarks/results/h100_2026-11-26"
MODELS = ("llama-3.1-8b", "meta-llama/llama-3.1-8b")  # the model every committed run used
SHAREGPT_LENGTHS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "h100_2026-11-26_sharegpt.json")


@dataclasses.dataclass(frozen=True)
class Case:
    """A run to replay: its requests, their arrival rate and the engine's options."""

    name: str
    workload: Workload
    request_rate: float = float("inf")
    async_scheduling: bool = True
    enable_prefix_caching: bool = True


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measured figure: `value` at `key` of `source`, predicted as `figure` of `case`'s replay."""

    case: str
    source: str
    key: str
    value: float
    figure: str
    bound: float | None


def h100_sharegpt_workload() -> Workload:
    """The first H100 run's 1,000 ShareGPT requests, as lengths (`data/h100_2026-11-26_sharegpt.json`)."""
    with open(SHAREGPT_LENGTHS) as f:
        data = json.load(f)
    return lengths_workload(
        "sharegpt (the first H100 run's sample)", list(zip(data["prompt_lens"], data["output_lens"]))
    )


def cases() -> dict[str, Case]:
    serve = random_workload(200, 200, 180)
    return {
        "latency": Case("latency", random_workload(1, 32, 128), enable_prefix_caching=False),
        "latency_sync": Case(
            "latency_sync", random_workload(1, 32, 128), async_scheduling=False, enable_prefix_caching=False
        ),
        "random_512_128": Case("random_512_128", random_workload(256, 512, 128)),
        "sharegpt": Case("sharegpt", h100_sharegpt_workload()),
        "serve_4": Case("serve_4", serve, 4.0),
        "serve_16": Case("serve_16", serve, 16.0),
        "serve_inf": Case("serve_inf", serve),
    }


def _serve(rate: str, case: str, measured: dict[str, float]) -> list[Measurement]:
    source = f"{RUN}/serve_{rate}qps.json"
    figures = {
        "duration": ("duration_s", THROUGHPUT_BOUND),
        "median_ttft_ms": ("ttft_ms.median", TTFT_BOUND),
        "p99_ttft_ms": ("ttft_ms.p99", None),
        "median_tpot_ms": ("tpot_ms.median", MEDIAN_LATENCY_BOUND),
        "median_itl_ms": ("itl_ms.median", MEDIAN_LATENCY_BOUND),
    }
    return [Measurement(case, source, key, measured[key], *figures[key]) for key in figures]


MEASUREMENTS = [
    Measurement("latency", f"{RUN}/latency.json", "avg_latency", 0.8117907908999967, "duration_s", THROUGHPUT_BOUND),
    Measurement(
        "latency",
        f"{RUN}/quantization_engine_summary.json",
        "stages[0].steps[0].result.avg_latency",
        0.8058261741999957,
        "duration_s",
        THROUGHPUT_BOUND,
    ),
    Measurement(
        "latency_sync", f"{RUN}/latency_sync.json", "avg_latency", 0.8697000309999993, "duration_s", THROUGHPUT_BOUND
    ),
    Measurement(
        "random_512_128",
        f"{RUN}/quantization_engine_summary.json",
        "stages[0].steps[1].result.elapsed_time",
        6.363197621000012,
        "duration_s",
        THROUGHPUT_BOUND,
    ),
    Measurement(
        "sharegpt",
        f"{RUN}/throughput_sharegpt.json",
        "elapsed_time",
        60.369055685000006,
        "duration_s",
        THROUGHPUT_BOUND,
    ),
    *_serve(
        "4",
        "serve_4",
        {
            "duration": 51.18292936499995,
            "median_ttft_ms": 51.7066115000091,
            "p99_ttft_ms": 139.05176136997568,
            "median_tpot_ms": 6.523639516759767,
            "median_itl_ms": 25.455623000027572,
        },
    ),
    *_serve(
        "16",
        "serve_16",
        {
            "duration": 13.736750939999979,
            "median_ttft_ms": 48.5789114999875,
            "p99_ttft_ms": 90.01335476001081,
            "median_tpot_ms": 7.079299575419064,
            "median_itl_ms": 27.003753000030883,
        },
    ),
    *_serve(
        "inf",
        "serve_inf",
        {
            "duration": 3.0502031930000157,
            "median_ttft_ms": 374.62797399999204,
            "p99_ttft_ms": 888.843078200012,
            "median_tpot_ms": 12.928429245810113,
            "median_itl_ms": 44.90499750002641,
        },
    ),
]


def replay_case(case: Case, buckets: BucketFactory, costs: StepCosts = StepCosts()) -> dict:
    """The model's prediction for one committed run (its engine as it ran)."""
    query = ThroughputQuery(
        workload=case.workload,
        model=MODELS[0],
        gpu="h100",
        request_rate=case.request_rate,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        async_scheduling=case.async_scheduling,
        enable_prefix_caching=case.enable_prefix_caching,
        costs=costs,
        levers=Levers(decode_kernel_in_mixed=False, three_quarter_buckets=False),  # the engine of those runs
    )
    return predict(query, buckets)["predicted"]


def figure(predicted: dict, path: str) -> float:
    """`predicted["ttft_ms"]["median"]` for "ttft_ms.median"."""
    value = predicted
    for part in path.split("."):
        value = value[part]
    return value


def calibrate(buckets: BucketFactory, costs: StepCosts = StepCosts(), only: set[str] | None = None) -> list[dict]:
    """One row per measurement (of the cases in `only`, None: all): measured, model, relative
    error and its bound."""
    predicted = {
        name: replay_case(case, buckets, costs) for name, case in cases().items() if only is None or name in only
    }
    rows = []
    for m in MEASUREMENTS:
        if m.case not in predicted:
            continue
        model = figure(predicted[m.case], m.figure)
        rows.append(
            {
                "case": m.case,
                "source": m.source,
                "key": m.key,
                "measured": m.value,
                "model": model,
                "error": model / m.value - 1,
                "bound": m.bound,
            }
        )
    return rows


def format_calibration(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = ["| case | measured (file: key) | measured | model | error | bound |", "|---|---|---|---|---|---|"]
    for r in rows:
        bound = f"±{r['bound']:.0%}" if r["bound"] is not None else "not modelled"
        lines.append(
            f"| {r['case']} | {os.path.basename(r['source'])}: {r['key']} | {r['measured']:.4g} | {r['model']:.4g} | "
            f"{r['error']:+.1%} | {bound} |"
        )
    return "\n".join(lines)
