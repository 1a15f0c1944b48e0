"""A replica killed under load behind vllm-router: which requests are lost, and does the replica
rejoin when it comes back.

Two `jaxpaged serve` replicas of the demo model behind `vllm-router --policy round_robin` (its
retries and health checks at their defaults but a 1 s health-check interval); `--requests`
streamed completions, `--concurrency` at a time. Once a quarter of them have finished, replica 1
is killed with SIGKILL. Each request ends as: answered whole, failed before its first token
(lost although nothing was streamed: the goal is none), or cut after tokens were streamed
(nothing can recover those). Replica 1 is then started again on the same port, and requests go
through the router, one a second, until the restarted replica has answered one (at most 120 s:
the router's circuit breaker keeps a failed worker out for its timeout).

    python -m benchmarks.router_failover [--router vllm-router]
        [--output benchmarks/results/router_failover_cpu_demo.json]
"""

import argparse
import concurrent.futures
import signal
import subprocess
import sys
import threading
import time

import httpx

from benchmarks.results_files import save_results
from benchmarks.router_policies import free_port, wait_for


def start_replica(port: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "jaxpaged.cli", "serve", "--port", str(port), "--host", "127.0.0.1"]
    argv += ["--max-model-len", "256", "--served-model-name", "demo", "--uvicorn-log-level", "warning"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stream_one(url: str, i: int, max_tokens: int) -> str:
    """ "ok", "lost" (failed before any token) or "cut" (failed after tokens came)."""
    body = {"model": "demo", "prompt": f"And it came to pass, {i}", "max_tokens": max_tokens, "stream": True}
    body["ignore_eos"] = True
    got_token = False
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            if response.status_code != 200:
                return "lost"
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    return "ok"
                if line.startswith("data: ") and '"error"' not in line:
                    got_token = True
                elif '"error"' in line:
                    break
    except httpx.HTTPError:
        pass
    return "cut" if got_token else "lost"


def served_requests(url: str) -> float:
    """Requests a replica finished, any finish reason."""
    lines = httpx.get(f"{url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("vllm:request_success_total"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--router", default="vllm-router", help="the vllm-router executable (pip install vllm-router)")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--output", default="benchmarks/results/router_failover_cpu_demo.json")
    args = parser.parse_args()
    ports = [free_port(), free_port()]
    replicas = [start_replica(port) for port in ports]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    router = None
    try:
        for url, process in zip(urls, replicas):
            wait_for(f"{url}/health", 600, process)
        port = free_port()
        argv = [args.router, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
        argv += ["--health-check-interval-secs", "1", "--worker-urls", *urls]
        router = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        target = f"http://127.0.0.1:{port}"
        wait_for(f"{target}/health", 60, router)
        done = []
        killed = threading.Event()

        def one(i: int) -> str:
            outcome = stream_one(target, i, args.max_tokens)
            done.append(outcome)
            if len(done) >= args.requests // 4 and not killed.is_set():
                killed.set()
                replicas[1].send_signal(signal.SIGKILL)
            return outcome

        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            outcomes = list(pool.map(one, range(args.requests)))
        replicas[1].wait(timeout=30)
        replicas[1] = start_replica(ports[1])
        wait_for(f"{urls[1]}/health", 600, replicas[1])
        back, after = time.monotonic(), []
        while served_requests(urls[1]) == 0 and time.monotonic() - back < 120:  # its circuit breaker reopens
            after.append(stream_one(target, 1000 + len(after), 4))
            time.sleep(1)
        rejoined = served_requests(urls[1])
        rejoin_seconds = time.monotonic() - back if rejoined else None
    finally:
        if router is not None:
            router.terminate()
            router.wait(timeout=30)
        for process in replicas:
            process.terminate()
        for process in replicas:
            process.wait(timeout=60)
    counts = {k: outcomes.count(k) for k in ("ok", "lost", "cut")}
    report = {
        "command": "python -m benchmarks.router_failover " + " ".join(sys.argv[1:]),
        "args": vars(args),
        "during": counts,
        "after_restart": {k: after.count(k) for k in ("ok", "lost", "cut")},
        "restarted_replica_answered": rejoined,
        "seconds_until_it_answered": rejoin_seconds,
    }
    print(report)
    table = (
        f"`{report['command']}`: {args.requests} streamed requests, {args.concurrency} at a time, through "
        "vllm-router round robin over two demo-model replicas; replica 1 killed (SIGKILL) after a quarter.\n\n"
        "| answered whole | lost before the first token | cut while streaming | after restart: answered / sent "
        "until the replica answered one | seconds until it did |\n|---|---|---|---|---|\n"
        f"| {counts['ok']} | {counts['lost']} | {counts['cut']} | {after.count('ok')} / {len(after)} | "
        f"{'never (120 s)' if rejoin_seconds is None else f'{rejoin_seconds:.0f}'} |\n"
    )
    save_results(args.output, report, table)


if __name__ == "__main__":
    main()
