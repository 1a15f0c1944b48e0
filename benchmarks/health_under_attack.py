"""`/health` latency while one hostile client attacks `jaxpaged serve` (issue 25's defects).

Starts the demo-model server in a subprocess (with an API key), then runs each attack in turn
while a prober (a process of its own) asks `GET /health` every 20 ms; reports the probes' p50,
p99 and max, probes that failed, and what the attack itself saw (response bytes, whether the
server closed the connection, how long a small concurrent completion took). Attack sizes are
scaled so the whole run takes a few minutes on a 2-core CPU.

    python -m benchmarks.health_under_attack --json benchmarks/results/health_under_attack_cpu_demo_after.json
    python -m benchmarks.health_under_attack --serve-arg=--timeout-header --serve-arg=5 ...

Attacks (D-numbers are issue 25's):
  idle          nothing (the baseline)
  float_list    D1: `prompt: [1.5] * 250,000` (1 MiB), three times
  role_list     D1: chat `messages: [{"role": 1}] * 60,000`, three times
  int_list      D8: four concurrent `prompt: [5] * 500,000` (1.5 MiB each)
  detokenize_list  D8: `/detokenize` of 1,000,000 ids (3 MiB), three times
  header_hold   D2: 2,000 sockets send `GET /health HTTP/1.1\\r\\nHost: x\\r\\n` and nothing more
  chunked_401   D3: a chunked body without the key, one byte per chunk, for 10 s
  stop_ids      D4: `stop_token_ids` of 200,000 ids with n=16, beside a small completion
  big_response  D5: n=32, max_tokens=400, top_logprobs=20
  cache_salt    D6: a 3 MB `cache_salt` on a 400-token prompt, beside a small completion
  long_role     D9: a 3 MB `role`, three times
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from benchmarks.results_files import save_results

KEY = "sk-bench"
PROBE_INTERVAL = 0.02
VOCAB_IDS = 200  # token ids below the demo model's vocabulary size


class Server:
    """`jaxpaged serve` on the demo model, on a free port, with `extra` flags."""

    def __init__(self, extra: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        argv = ["serve", "--port", str(self.port), "--api-key", KEY, "--dtype", "float32", "--max-model-len", "512"]
        argv += ["--uvicorn-log-level", "warning", *extra]
        code = f"import sys; from jaxpaged.cli import main; sys.exit(main({argv!r}))"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.getcwd()}
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.time() + 300
        while True:
            assert self.proc.poll() is None, open(self.log.name).read()
            try:
                if httpx.get(self.url + "/health", trust_env=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "the server did not become ready"
            time.sleep(0.25)

    def client(self, timeout: float = 120) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, trust_env=False, timeout=timeout, headers={"Authorization": f"Bearer {KEY}"}
        )

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def probe(port: int, stop, started, results) -> None:
    """Runs in a process of its own (the attacks' own JSON encoding holds this process's
    interpreter lock for a fifth of a second, which a prober thread here would count): sends
    `results` the seconds each `/health` took until `stop`, and how many failed (error, timeout,
    not 200); sets `started` after the first."""
    latencies, failures = [], 0
    while not stop.is_set():
        start = time.perf_counter()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # a new connection, as a probe
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                ok = s.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:
            ok = False
        latencies.append(time.perf_counter() - start)
        failures += not ok
        started.set()
        time.sleep(PROBE_INTERVAL)
    results.send((latencies, failures))


def victim(server: Server) -> float:
    """Seconds a small completion takes (8 tokens)."""
    start = time.perf_counter()
    with server.client() as http:
        r = http.post("/v1/completions", json={"prompt": "In the beginning", "max_tokens": 8, "temperature": 0})
    return time.perf_counter() - start if r.status_code == 200 else float("nan")


def post_repeatedly(server: Server, path: str, body: dict, times: int) -> dict:
    payload = json.dumps(body).encode()
    sizes, statuses = [], []
    with server.client() as http:
        for _ in range(times):
            r = http.post(path, content=payload, headers={"Content-Type": "application/json"})
            sizes.append(len(r.content))
            statuses.append(r.status_code)
    return {"request_bytes": len(payload), "response_bytes": max(sizes), "statuses": sorted(set(statuses))}


def float_list(server):
    return post_repeatedly(server, "/v1/completions", {"model": "demo", "prompt": [1.5] * 250_000}, 3)


def role_list(server):
    return post_repeatedly(server, "/v1/chat/completions", {"messages": [{"role": 1}] * 60_000}, 3)


def detokenize_list(server):
    return post_repeatedly(server, "/detokenize", {"tokens": [5] * 1_000_000}, 3)


def long_role(server):
    return post_repeatedly(server, "/v1/chat/completions", {"messages": [{"role": "u" * 3_000_000}]}, 3)


def int_list(server):
    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=120, headers=headers) as http:
            body = {"prompt": [5] * 500_000, "max_tokens": 1}
            return await asyncio.gather(*[http.post("/v1/completions", json=body) for _ in range(4)])

    return {"statuses": sorted({r.status_code for r in asyncio.run(run())})}


def header_hold(server, count: int = 2000, hold: float = 12.0):
    sockets = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        s.setblocking(False)
        sockets.append(s)
    time.sleep(hold)
    closed = 0
    for s in sockets:
        try:
            closed += s.recv(1 << 16) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed += 1
        s.close()
    return {"connections": count, "held_s": hold, "closed_by_server": closed}


def chunked_401(server, seconds: float = 10.0):
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    end, sent, closed, status = time.time() + seconds, 0, False, None
    s.settimeout(0.001)
    while time.time() < end:
        try:
            s.sendall(b"1\r\n{\r\n")
            sent += 1
            data = s.recv(4096)
            if data == b"":
                closed = True
                break
            status = status or data[:12].decode(errors="replace")
        except TimeoutError:
            pass
        except OSError:
            closed = True
            break
    s.close()
    return {"status": status, "chunks_sent": sent, "closed_by_server": closed}


def with_victim(server, attack) -> dict:
    result = {}
    thread = threading.Thread(target=lambda: result.update(attack()))
    thread.start()
    time.sleep(1.0)  # the attack has reached the engine
    seconds = victim(server)
    thread.join()
    return {**result, "victim_completion_s": round(seconds, 3)}


def stop_ids(server):
    body = {
        "prompt": "And",
        "n": 16,
        "max_tokens": 200,
        "ignore_eos": True,
        "stop_token_ids": list(range(VOCAB_IDS)) * 1000,
    }
    return with_victim(server, lambda: post_repeatedly(server, "/v1/completions", body, 1))


def big_response(server):
    body = {"messages": [{"role": "user", "content": "Hi"}], "n": 32, "max_tokens": 400, "logprobs": True}
    return post_repeatedly(server, "/v1/chat/completions", {**body, "top_logprobs": 20, "ignore_eos": True}, 1)


def cache_salt(server):
    body = {"prompt": [5] * 400, "max_tokens": 1, "cache_salt": "s" * 3_000_000}
    return with_victim(server, lambda: post_repeatedly(server, "/v1/completions", body, 2))


def idle(server):
    time.sleep(5)
    return {}


ATTACKS = [
    idle,
    float_list,
    role_list,
    int_list,
    detokenize_list,
    header_hold,
    chunked_401,
    stop_ids,
    big_response,
    cache_salt,
    long_role,
]


def _p99(latencies: list[float]) -> float:
    return statistics.quantiles(latencies, n=100, method="inclusive")[98] if len(latencies) > 1 else latencies[0]


class Prober:
    """`probe` in a process of its own, from construction (once its first probe is answered)
    until `stop()`, which returns `(latencies in seconds, failed probes)`."""

    def __init__(self, port: int):
        context = multiprocessing.get_context("spawn")
        self._stop, started = context.Event(), context.Event()
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(target=probe, args=(port, self._stop, started, send))
        self._process.start()
        started.wait(60)

    def stop(self) -> tuple[list[float], int]:
        self._stop.set()
        result = self._receive.recv()
        self._process.join()
        return result


def run_attack(server: Server, attack) -> dict:
    """What `attack(server)` saw; its own failure (e.g. a reset connection) is a result too."""
    try:
        return attack(server)
    except Exception as err:
        return {"attack_error": f"{type(err).__name__}: {err}"[:200]}


def measure(server: Server, attack) -> dict:
    prober = Prober(server.port)
    start = time.perf_counter()
    seen = run_attack(server, attack)
    seconds = time.perf_counter() - start
    latencies, failures = prober.stop()
    time.sleep(1.0)  # let the server settle before the next attack
    return {
        "attack": attack.__name__,
        "seconds": round(seconds, 1),
        "probes": len(latencies),
        "failed_probes": failures,
        "health_p50_ms": round(statistics.median(latencies) * 1e3, 1),
        "health_p99_ms": round(_p99(latencies) * 1e3, 1),
        "health_max_ms": round(max(latencies) * 1e3, 1),
        "seen": seen,
    }


def table(rows: list[dict], label: str) -> str:
    lines = [
        f"`/health` under attack ({label}), demo model, {platform.node() or 'cpu'}",
        "",
        "| attack | s | probes | failed | p50 ms | p99 ms | max ms | what the attacker saw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        seen = ", ".join(f"{k}={v}" for k, v in r["seen"].items())
        lines.append(
            f"| {r['attack']} | {r['seconds']} | {r['probes']} | {r['failed_probes']} | {r['health_p50_ms']} | "
            f"{r['health_p99_ms']} | {r['health_max_ms']} | {seen} |"
        )
    return "\n".join(lines)


def attack_parser(doc: str) -> argparse.ArgumentParser:
    """The flags of an attack benchmark (this one and grammar_attacks.py), described by `doc`'s
    first line."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--json", help="write the report here (and a markdown table beside it)")
    parser.add_argument("--label", default="", help="what this run measures (e.g. 'before the fixes')")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra `jaxpaged serve` argument")
    parser.add_argument("--only", nargs="*", help="attack names to run (default: all)")
    return parser


def main() -> None:
    args = attack_parser(__doc__).parse_args()
    server = Server(args.serve_arg)
    try:
        rows = []
        for attack in ATTACKS:
            if args.only and attack.__name__ not in args.only:
                continue
            rows.append(measure(server, attack))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.close()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"label": args.label, "commit": commit, "serve_args": args.serve_arg, "cpus": os.cpu_count(), "rows": rows}
    text = table(rows, args.label or commit)
    print(text)
    if args.json:
        save_results(args.json, report, text)


if __name__ == "__main__":
    main()
