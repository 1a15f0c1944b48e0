"""vllm-router's policies over jaxpaged replicas, on the clinical workload's shape: prefix-cache
hit rate and time to first token per policy, against one replica alone, in the same run.

N `jaxpaged serve` replicas of the demo model (each publishing KV events) start once; for each
policy a router starts in front of them (`kv_aware` following the events), every replica's
prefix cache is reset, and the same requests are sent: `--tasks` tasks, each its own shared
instruction prefix (the first `--prefix-chars` characters of the extraction workload's
instruction and few-shot examples, under the task's name: about 400 of the demo model's tokens)
and `--notes` notes of its own (about 100 tokens), in a seeded shuffled order, `--concurrency` at a
time, each streamed with `--max-tokens` tokens out. The hit rate is the replicas' prefix-cache
hits over their lookups, in tokens (`vllm:prefix_cache_hits` / `_queries`); "one replica"
sends everything to the first replica directly.

    python -m benchmarks.router_policies [--replicas 2 3] [--router vllm-router]
        [--output benchmarks/results/router_policies_cpu_demo.json]
"""

import argparse
import concurrent.futures
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx

from benchmarks.results_files import save_results
from jaxpaged.bench.extraction_data import note_text, prefix_text

POLICIES = ("one replica", "round_robin", "cache_aware", "kv_aware")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, seconds: float, process: subprocess.Popen) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:4]} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {seconds} s")


def start_replicas(count: int, max_model_len: int) -> list[tuple[str, int, subprocess.Popen]]:
    """`count` demo-model servers with KV events on: (url, events port, process) each."""
    replicas = []
    env = {**os.environ, "JAXPAGED_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache between policies
    for _ in range(count):
        port, events = free_port(), free_port()
        config = f'{{"enable_kv_cache_events": true, "endpoint": "tcp://*:{events}"}}'
        argv = [sys.executable, "-m", "jaxpaged.cli", "serve", "--port", str(port), "--host", "127.0.0.1"]
        argv += ["--max-model-len", str(max_model_len), "--kv-events-config", config, "--served-model-name", "demo"]
        argv += ["--uvicorn-log-level", "warning"]
        replicas.append((f"http://127.0.0.1:{port}", events, subprocess.Popen(argv, env=env)))
    for url, _, process in replicas:
        wait_for(f"{url}/health", 600, process)
    return replicas


def prefix_counters(urls: list[str]) -> tuple[float, float]:
    """The replicas' prefix-cache (hits, queries) in tokens, summed."""
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.split()[-1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.split()[-1])
    return hits, queries


def first_token_seconds(base_url: str, prompt: str, max_tokens: int) -> float:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    start = time.perf_counter()
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return time.perf_counter() - start
    raise RuntimeError("the stream carried no token")


def run_policy(policy: str, replicas, prompts: list[str], args, block_size: int) -> dict:
    urls = [url for url, _, _ in replicas]
    for url in urls:
        httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
    router = None
    target = urls[0]
    if policy != "one replica":
        port = free_port()
        argv = [args.router, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, "--worker-urls", *urls]
        if policy == "kv_aware":
            argv += ["--kv-event-model", "demo", "--kv-event-block-size", str(block_size), "--router-temperature", "0"]
            for url, events, _ in replicas:
                argv += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{events}"]
        metrics_port = free_port()
        argv += ["--prometheus-port", str(metrics_port), "--prometheus-host", "127.0.0.1", "--log-level", "debug"]
        log = open(os.path.join(args.router_log_dir, f"router_{len(replicas)}_{policy}.log"), "w")
        router = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        target = f"http://127.0.0.1:{port}"
        wait_for(f"{target}/health", 60, router)
        time.sleep(1.0)  # its KV event subscriptions join the publishers
    try:
        hits0, queries0 = prefix_counters(urls)
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            ttfts = list(pool.map(lambda p: first_token_seconds(target, p, args.max_tokens), prompts))
        time.sleep(1.0)  # the last steps' counters
        hits1, queries1 = prefix_counters(urls)
        if policy == "kv_aware":
            text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text
            print("router:", [line for line in text.splitlines() if "kv_placement" in line and line[0] != "#"])
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=30)
            log.close()
    # the router's own count of its placements that reused a prefix (its log, complete once it ended)
    credited = _placements_with_prefix(log.name) if policy == "kv_aware" else None
    return {
        "router_placed_on_a_held_prefix": credited,
        "policy": policy,
        "hit_rate": (hits1 - hits0) / max(queries1 - queries0, 1),
        "ttft_p50_ms": statistics.median(ttfts) * 1e3,
        "ttft_mean_ms": statistics.fmean(ttfts) * 1e3,
    }


def _placements_with_prefix(log_path: str) -> str:
    """ "k of n": the router's kv_aware decisions (its debug log) that chose a replica holding
    some of the prompt's blocks."""
    import re

    with open(log_path, errors="replace") as f:
        text = re.sub(r"\x1b\[[0-9;]*m", "", f.read())  # its terminal colours
    credits = [int(c) for c in re.findall(r"KV prefix decision.*?credited_prefix_tokens=(\d+)", text)]
    return f"{sum(c > 0 for c in credits)} of {len(credits)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--router", default="vllm-router", help="the vllm-router executable (pip install vllm-router)")
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--notes", type=int, default=8, help="requests per task")
    parser.add_argument("--prefix-chars", type=int, default=800)
    parser.add_argument("--note-words", type=int, default=30)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--router-log-dir", default="/tmp", help="where each router's debug log is written")
    parser.add_argument("--output", default="benchmarks/results/router_policies_cpu_demo.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prompts = [
        f"Task {task}.\n{prefix_text()[: args.prefix_chars]}\nNote: {note_text(rng, args.note_words)}\nJSON: "
        for task in range(args.tasks)
        for _ in range(args.notes)
    ]
    rng.shuffle(prompts)
    rows = []
    for count in args.replicas:
        replicas = start_replicas(count, args.max_model_len)
        try:
            for policy in POLICIES:
                row = {"replicas": count, **run_policy(policy, replicas, prompts, args, block_size=16)}
                print(row, flush=True)
                rows.append(row)
        finally:
            for _, _, process in replicas:
                process.terminate()
            for _, _, process in replicas:
                process.wait(timeout=60)
    table = [
        "| replicas | policy | prefix-cache hit rate | TTFT p50 (ms) | TTFT mean (ms) | kv_aware: placed on a held prefix |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['replicas']} | {r['policy']} | {r['hit_rate']:.2f} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_mean_ms']:.0f} | {r['router_placed_on_a_held_prefix'] or ''} |"
        )
    command = "python -m benchmarks.router_policies " + " ".join(sys.argv[1:])
    report = {"command": command, "args": vars(args), "rows": rows}
    head = (
        f"`{command}`: {args.tasks} tasks x {args.notes} notes, {args.concurrency} at a time, demo model on this "
        "machine's CPU, one process per replica.\n\n"
    )
    save_results(args.output, report, head + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
