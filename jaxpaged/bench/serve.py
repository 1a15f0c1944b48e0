"""`jaxpaged bench serve`: load an OpenAI-compatible server and report vLLM's serving metrics.

    jaxpaged serve --port 8000 &                                  # or vLLM, or any OpenAI-compatible server
    jaxpaged bench serve --port 8000 --num-prompts 200 --request-rate 4 --save-result --result-dir out/

1. Ask the server for its model and context (`GET /v1/models`) unless `--model` is given.
2. Build the requests (`--dataset-name`; token counts with `--tokenizer`), then send them on a
   Poisson/gamma schedule (`serve_client.py`), streaming, and time every token.
3. Print vLLM's table (successful and failed requests, throughputs, TTFT/TPOT/ITL/E2EL) and, with
   `--save-result`, write the JSON with vLLM's keys.

Needs the bench extra (httpx); imports no JAX.
"""

import argparse
import asyncio
import datetime
import importlib.util
import json
import os
import sys

from jaxpaged.bench import datasets, metrics, sharegpt
from jaxpaged.entrypoints.cli_flags import PORT

RESULT_WIDTH = 50
BACKENDS = ("vllm", "openai", "openai-chat")
# What a result keeps without --save-detailed (vLLM drops these per-request lists too).
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a request rate must be positive (inf sends all at once)")
    return value


def add_serve_bench_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of `bench serve` (vLLM's names)."""
    parser.add_argument(
        "--base-url", metavar="URL", help="the server's URL, e.g. http://10.0.0.1:8000 (default: from --host/--port)"
    )
    parser.add_argument("--host", default="127.0.0.1", metavar="HOST", help="the server's host (without --base-url)")
    parser.add_argument("--port", type=PORT, default=8000, help="the server's port (without --base-url)")
    parser.add_argument(
        "--backend",
        "--endpoint-type",
        choices=BACKENDS,
        help="the API to speak (vLLM's names): vllm and openai send completions, openai-chat chat "
        "completions (ShareGPT prompts only); --endpoint-type is vLLM's older name of this flag (default: "
        "openai-chat with a chat --endpoint, else vllm)",
    )
    parser.add_argument(
        "--endpoint",
        metavar="PATH",
        help="the route to load (default: /v1/chat/completions with --backend openai-chat, else /v1/completions)",
    )
    parser.add_argument(
        "--model", metavar="NAME", help="the model name to send (default: the first of the server's /v1/models)"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        metavar="KEY",
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, else none)",
    )
    parser.add_argument(
        "--tokenizer",
        metavar="DIR",
        help="tokenizer that counts the dataset's tokens (default: --model "
        "when it is a directory with tokenizer files, else the embedded demo model's)",
    )
    datasets.add_dataset_flags(parser, default_num_prompts=1000)
    parser.add_argument(
        "--seed", type=int, default=0, metavar="N", help="seeds the dataset sample and the arrival times"
    )
    parser.add_argument(
        "--request-rate",
        type=_rate,
        default=float("inf"),
        metavar="RATE",
        help="requests per second (Poisson arrivals); inf sends every request at once",
    )
    parser.add_argument(
        "--burstiness",
        type=_rate,
        default=1.0,
        metavar="X",
        help="gamma shape of the gaps between arrivals: 1 is Poisson, below 1 burstier, above 1 more even",
    )
    parser.add_argument("--max-concurrency", type=int, metavar="N", help="most requests in flight (default: no cap)")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to generate past EOS (always on for "
        "random and prefix, so every request gets its --output-len)",
    )
    parser.add_argument(
        "--temperature", type=float, metavar="X", help="sent with every request (default: the server's)"
    )
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.add_argument(
        "--percentile-metrics",
        default=metrics.DEFAULT_PERCENTILE_METRICS,
        metavar="LIST",
        help=f"metrics to report statistics of ({', '.join(metrics.METRICS)})",
    )
    parser.add_argument(
        "--metric-percentiles",
        default=metrics.DEFAULT_METRIC_PERCENTILES,
        metavar="LIST",
        help="percentiles to report, comma-separated, e.g. 50,90,99",
    )
    parser.add_argument(
        "--goodput",
        nargs="+",
        metavar="METRIC:MS",
        help="service-level objectives for goodput, "
        "e.g. ttft:500 tpot:50 e2el:5000 (ms): requests/s that meet all of them",
    )
    parser.add_argument(
        "--num-warmups",
        type=int,
        default=0,
        metavar="N",
        help="send the first N requests once, untimed, before the run",
    )
    parser.add_argument("--save-result", action="store_true", help="write the result JSON")
    parser.add_argument(
        "--save-detailed",
        action="store_true",
        help="keep the per-request lists in the result JSON (input_lens, output_lens, start_times, ttfts, itls, "
        "generated_texts, errors)",
    )
    parser.add_argument(
        "--label",
        metavar="NAME",
        help="the run's label: saved in the result and the file name's start (default: jaxpaged)",
    )
    parser.add_argument("--result-dir", metavar="DIR", help="directory of the result JSON (default: the current one)")
    parser.add_argument(
        "--result-filename",
        metavar="FILE",
        help="name of the result JSON (default: jaxpaged-{rate}qps-{model}-{date}.json)",
    )


def run(args: argparse.Namespace) -> int:
    """`jaxpaged bench serve` with parsed arguments; 0 when every request succeeded, 1 otherwise."""
    missing = [m for m in ("httpx",) if importlib.util.find_spec(m) is None]
    if missing:
        print(
            f"jaxpaged bench serve needs the bench extra ({', '.join(missing)} missing): pip install 'jaxpaged[bench]'",
            file=sys.stderr,
        )
        return 1
    datasets.check_dataset_flags(args)
    slos = metrics.parse_goodput(args.goodput)
    selected = metrics.parse_percentile_metrics(args.percentile_metrics)
    percentiles = metrics.parse_metric_percentiles(args.metric_percentiles)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {args.max_concurrency}: must be at least 1")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups {args.num_warmups}: must be at least 0")
    if args.endpoint is None:  # from --backend (vLLM's default: vllm, the completions API)
        args.endpoint = "/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions"
    chat = args.endpoint.rstrip("/").endswith("chat/completions")
    if args.backend is None:  # from --endpoint
        args.backend = "openai-chat" if chat else "vllm"
    if chat != (args.backend == "openai-chat"):
        raise ValueError(
            f"--endpoint {args.endpoint} does not fit --backend {args.backend}: openai-chat speaks "
            "/v1/chat/completions, vllm and openai /v1/completions"
        )
    if chat and args.dataset_name != "sharegpt":
        raise ValueError(
            f"--endpoint {args.endpoint} takes text; --dataset-name {args.dataset_name} makes token-id "
            "prompts: use --endpoint /v1/completions"
        )
    result = asyncio.run(_benchmark(args, chat=chat, slos=slos, selected=selected, percentiles=percentiles))
    _print_result(result, args, selected, percentiles)
    if not args.save_detailed:
        for key in DETAILED_KEYS:
            result.pop(key)
    if args.save_result:
        path = _result_path(args, result["model_id"], result["date"])
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}", file=sys.stderr)
    return 0 if result["failed"] == 0 else 1


async def _benchmark(args, *, chat: bool, slos: dict, selected: list[str], percentiles: list[float]) -> dict:
    import httpx
    from transformers import AutoTokenizer

    from jaxpaged.bench import serve_client

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, headers=headers, limits=limits, trust_env=False) as client:
        model, max_model_len = await _server_model(client, base_url, args.model)
        tokenizer_dir = datasets.dataset_tokenizer_dir(args.model or "", args.tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        requests = datasets.get_requests(
            args,
            tokenizer=tokenizer,
            vocab_size=len(tokenizer),
            seed=args.seed,
            max_model_len=max_model_len or sharegpt.MAX_TOTAL_LEN,
        )
        ignore_eos = args.ignore_eos or args.dataset_name != "sharegpt"
        bodies = [
            serve_client.request_body(r, model=model, chat=chat, ignore_eos=ignore_eos, temperature=args.temperature)
            for r in requests
        ]
        if args.num_warmups:
            warm = [bodies[i % len(bodies)] for i in range(args.num_warmups)]
            print(f"{len(warm)} warm-up requests (untimed) ...", file=sys.stderr)
            warmed, _ = await serve_client.run_requests(
                client, base_url + args.endpoint, warm, [0] * len(warm), [0.0] * len(warm), args.max_concurrency, False
            )
            failed = [r.error for r in warmed if not r.success]
            if failed:
                print(f"{len(failed)} warm-up requests failed: {failed[0]}", file=sys.stderr)
        send_at = serve_client.arrival_times(len(requests), args.request_rate, args.burstiness, args.seed)
        print(
            f"{len(requests)} {args.dataset_name} requests to {base_url}{args.endpoint} (model {model}); request rate "
            f"{args.request_rate} (burstiness {args.burstiness}); max concurrency {args.max_concurrency}",
            file=sys.stderr,
        )
        results, duration = await serve_client.run_requests(
            client,
            base_url + args.endpoint,
            bodies,
            [r.prompt_len for r in requests],
            send_at,
            args.max_concurrency,
            not args.disable_tqdm,
        )
    summary = metrics.summarize(results, duration, percentile_metrics=selected, percentiles=percentiles, goodput=slos)
    setup = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "label": args.label,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": tokenizer_dir,
        "dataset_name": args.dataset_name,
        "num_prompts": len(requests),
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }
    return {**setup, **summary}


async def _server_model(client, base_url: str, model: str | None) -> tuple[str, int | None]:
    """The model to ask for and the server's context (None when /v1/models does not say)."""
    import httpx

    try:
        response = await client.get(base_url + "/v1/models")
        response.raise_for_status()
        listed = response.json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as err:
        raise ValueError(
            f"cannot list the models at {base_url}/v1/models ({err}); is the server up at --base-url or --host/--port?"
        ) from None
    entry = next((m for m in listed if model in (None, m.get("id"))), None)
    if entry is None:
        raise ValueError(f"--model {model}: the server serves {[m.get('id') for m in listed]}")
    return entry["id"], entry.get("max_model_len")


def _result_path(args, model: str, date: str) -> str:
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    name = (
        args.result_filename
        or f"{args.label or 'jaxpaged'}-{rate}qps-{os.path.basename(model.rstrip('/'))}-{date}.json"
    )
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        return os.path.join(args.result_dir, name)
    return name


def _print_result(result: dict, args, selected: list[str], percentiles: list[float]) -> None:
    def row(label: str, value) -> None:
        print(f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}")

    print(" Serving Benchmark Result ".center(RESULT_WIDTH, "="))
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if args.max_concurrency is not None:
        row("Maximum request concurrency:", args.max_concurrency)
    if args.request_rate != float("inf"):
        row("Request rate configured (RPS):", args.request_rate)
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result["request_goodput"] is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    headers = {
        "ttft": ("TTFT", "Time to First Token"),
        "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
        "itl": ("ITL", "Inter-token Latency"),
        "e2el": ("E2EL", "End-to-end Latency"),
    }
    for metric in selected:
        short, header = headers[metric]
        print(header.center(RESULT_WIDTH, "-"))
        row(f"Mean {short} (ms):", result[f"mean_{metric}_ms"])
        row(f"Median {short} (ms):", result[f"median_{metric}_ms"])
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", result[metrics.percentile_key(metric, p)])
    print("=" * RESULT_WIDTH)
    errors = [e for e in result["errors"] if e]
    for error in errors[:5]:
        print(f"error: {error}", file=sys.stderr)
