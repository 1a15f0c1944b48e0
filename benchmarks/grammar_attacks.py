"""A neighbour's stream, `/health` and the server's memory while one client attacks with grammars
and log-probabilities (issue 44's cases).

Starts the demo-model server in a subprocess (`health_under_attack.Server`), then runs each
attack in turn while a neighbour streams completions back to back (the worst gap between its
chunks during the attack is the number that matters: a stalled engine shows there, not in
`/health`) and a prober process asks `GET /health` every 20 ms. Also reports what the attacker
saw (statuses, response bytes, error messages) and the server's memory (the resident set of its
process tree) before and after each attack; at the end, the engine's grammar compiles, cache hits
and compile-time histogram from `/metrics`.

    python -m benchmarks.grammar_attacks --json benchmarks/results/grammar_attacks_cpu_demo_after.json

Run from an older checkout's directory it measures that checkout (the server runs with
`PYTHONPATH` set to the working directory): the "before" row of each attack.

Attacks:
  idle              nothing (the baseline)
  wide_10k          4 concurrent JSON schemas of 10,000 optional properties (~290 KB each)
  wide_4k           4 concurrent schemas of 4,000 properties (~112 KB: under the size budget)
  recursive_n100    one request, n=100, under a recursive schema (max_tokens 48)
  recursive_100     100 concurrent requests under the same schema, n=1 (what n=100 should cost)
  choice_100k       `choice` of 100,000 options
  deep_300          a schema 300 objects deep, additional properties disabled
  ref_cycle         a `$ref` cycle (allows nothing)
  backtracking      regexes that backtrack catastrophically in a backtracking engine
  prompt_lp_big     256 prompts of 400 tokens with prompt_logprobs 20 (over the response budget)
  prompt_lp_budget  24 prompts of 400 tokens with prompt_logprobs 20 (inside it: the response and
                    the memory it leaves behind)
  prompt_lp_repeat  the same 4 times more, the memory after each (a plateau, or a leak)
"""

import asyncio
import json
import os
import platform
import statistics
import subprocess
import threading
import time

import httpx

from benchmarks.health_under_attack import KEY, Prober, Server, _p99, attack_parser, run_attack
from benchmarks.results_files import save_results

SCHEMA_MAX_TOKENS = 16


def _wide(properties: int, tag: int) -> dict:
    props = {f"p{i}": {"type": "string"} for i in range(properties)}
    props["tag"] = {"const": tag}  # a different grammar each: no cache hits
    return {"type": "object", "properties": props}


RECURSIVE = {
    "$ref": "#/$defs/node",
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["name", "children"],
        }
    },
}


def _chat(schema: dict, **fields) -> dict:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"messages": [{"role": "user", "content": "Hi"}], "response_format": fmt, "max_tokens": SCHEMA_MAX_TOKENS}
    return {**body, **fields}


class Neighbour:
    """Streams completions back to back on a thread of its own, recording when each chunk came."""

    def __init__(self, server: Server):
        self.times: list[float] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 120
        while len(self.times) < 5 and time.monotonic() < deadline:  # streaming (compiled) before the attack
            time.sleep(0.05)

    def _run(self, server: Server) -> None:
        body = {"prompt": "In the beginning", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with server.client(timeout=300) as http:
            while not self._stop.is_set():
                try:
                    with http.stream("POST", "/v1/completions", json=body) as response:
                        for line in response.iter_lines():
                            if line.startswith("data: {"):
                                self.times.append(time.monotonic())
                            if self._stop.is_set():
                                break
                except httpx.HTTPError:
                    self.errors += 1

    def worst_gap(self, start: float, end: float) -> float:
        """The longest the stream went without a chunk between `start` and `end` (s)."""
        inside = [start] + [t for t in self.times if start < t < end] + [end]
        return max(b - a for a, b in zip(inside, inside[1:]))

    def chunks(self, start: float, end: float) -> int:
        return sum(start < t < end for t in self.times)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(60)


def rss_mib(pid: int) -> float:
    """The resident memory of process `pid` and its descendants, MiB (Linux /proc)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    pending += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            pass
    return total / 1024


def _concurrent(server: Server, path: str, bodies: list[dict]) -> dict:
    async def run():
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=600, headers=headers) as http:
            return await asyncio.gather(*[http.post(path, json=b) for b in bodies], return_exceptions=True)

    responses = asyncio.run(run())
    errors = [f"{type(r).__name__}" for r in responses if isinstance(r, Exception)]
    answered = [r for r in responses if not isinstance(r, Exception)]
    statuses: dict[str, int] = {}
    for r in answered:
        statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
    seen = {"statuses": statuses, "response_bytes": max((len(r.content) for r in answered), default=0)}
    messages = {r.json()["error"]["message"][:120] for r in answered if r.status_code >= 400}
    finishes = {c.get("finish_reason") for r in answered if r.status_code == 200 for c in r.json().get("choices", [])}
    if messages:
        seen["errors"] = sorted(messages)[:2]
    if finishes:
        seen["finish_reasons"] = sorted(str(f) for f in finishes)
    if errors:
        seen["transport_errors"] = errors
    return seen


def idle(server):
    time.sleep(5)
    return {}


def wide_10k(server):
    return _concurrent(server, "/v1/chat/completions", [_chat(_wide(10_000, i)) for i in range(4)])


def wide_4k(server):
    return _concurrent(server, "/v1/chat/completions", [_chat(_wide(4_000, 10 + i)) for i in range(4)])


def recursive_n100(server):
    return _concurrent(server, "/v1/chat/completions", [_chat(RECURSIVE, n=100, max_tokens=48)])


def recursive_100(server):
    return _concurrent(server, "/v1/chat/completions", [_chat(RECURSIVE, max_tokens=48) for _ in range(100)])


def choice_100k(server):
    body = {"prompt": "x", "max_tokens": 8, "structured_outputs": {"choice": [f"option {i}" for i in range(100_000)]}}
    return _concurrent(server, "/v1/completions", [body])


def deep_300(server):
    schema: dict = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    body = _chat(schema)
    body["structured_outputs"] = {"disable_additional_properties": True}
    return _concurrent(server, "/v1/chat/completions", [body])


def ref_cycle(server):
    cycle = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    return _concurrent(server, "/v1/chat/completions", [_chat(cycle)])


def backtracking(server):
    regexes = ["(a+)+$", "(a|a)*b", "(a|aa)+$", "((a*)*)*b", "(x+x+)+y", "(.*a){20}"]
    bodies = [{"prompt": "x", "max_tokens": 16, "structured_outputs": {"regex": r}} for r in regexes]
    return _concurrent(server, "/v1/completions", bodies)


def _prompt_logprobs(prompts: int) -> dict:
    return {"prompt": [[5 + i % 100] * 400 for i in range(prompts)], "max_tokens": 1, "prompt_logprobs": 20}


def prompt_lp_big(server):
    return _concurrent(server, "/v1/completions", [_prompt_logprobs(256)])


def prompt_lp_budget(server):
    return _concurrent(server, "/v1/completions", [_prompt_logprobs(24)])


def prompt_lp_repeat(server):
    """`prompt_lp_budget` 4 more times, the memory after each: a plateau, or growth per response."""
    rss = []
    for _ in range(4):
        seen = _concurrent(server, "/v1/completions", [_prompt_logprobs(24)])
        time.sleep(2)
        rss.append(round(rss_mib(server.proc.pid)))
    return {**seen, "rss_after_each_mib": rss}


ATTACKS = [
    idle,
    wide_10k,
    wide_4k,
    recursive_n100,
    recursive_100,
    choice_100k,
    deep_300,
    ref_cycle,
    backtracking,
    prompt_lp_big,
    prompt_lp_budget,
    prompt_lp_repeat,
]


def grammar_metrics(server: Server) -> dict:
    """The engine's grammar counters from /metrics: compiles, cache hits (and their rate), and
    how many compiles took at most each bucket's seconds (empty before the counters existed)."""
    from prometheus_client.parser import text_string_to_metric_families

    with server.client() as http:
        text = http.get("/metrics").text
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    value = {s.name: s.value for s in samples if "le" not in s.labels}
    if "jaxpaged:grammar_compiles_total" not in value:
        return {}
    compiles, hits = value["jaxpaged:grammar_compiles_total"], value["jaxpaged:grammar_cache_hits_total"]
    buckets = {s.labels["le"]: int(s.value) for s in samples if s.name == "jaxpaged:grammar_compile_seconds_bucket"}
    return {
        "compiles": int(compiles),
        "cache_hits": int(hits),
        "cache_hit_rate": round(hits / (hits + compiles), 3) if hits + compiles else None,
        "compile_seconds_sum": round(value["jaxpaged:grammar_compile_seconds_sum"], 2),
        "compiles_within_seconds": buckets,
    }


def measure(server: Server, neighbour: Neighbour, attack) -> dict:
    prober = Prober(server.port)
    memory_before = rss_mib(server.proc.pid)
    start = time.monotonic()
    seen = run_attack(server, attack)
    end = time.monotonic()
    latencies, failures = prober.stop()
    time.sleep(3.0)  # let the server settle (and give memory back) before the next attack
    return {
        "attack": attack.__name__,
        "seconds": round(end - start, 1),
        "neighbour_worst_gap_s": round(neighbour.worst_gap(start, end), 3),
        "neighbour_chunks": neighbour.chunks(start, end),
        "health_p99_ms": round(_p99(latencies) * 1e3, 1),
        "health_max_ms": round(max(latencies) * 1e3, 1),
        "failed_probes": failures,
        "rss_before_mib": round(memory_before),
        "rss_after_mib": round(rss_mib(server.proc.pid)),
        "seen": seen,
    }


def table(rows: list[dict], label: str) -> str:
    lines = [
        f"Grammar and logprob attacks ({label}), demo model, {platform.node() or 'cpu'}, {os.cpu_count()} CPUs",
        "",
        "| attack | s | neighbour worst gap s | neighbour chunks | /health p99 ms | max ms | RSS MiB before → after | what the attacker saw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        seen = "; ".join(f"{k}={v}" for k, v in r["seen"].items()).replace("|", "\\|")
        lines.append(
            f"| {r['attack']} | {r['seconds']} | {r['neighbour_worst_gap_s']} | {r['neighbour_chunks']} | "
            f"{r['health_p99_ms']} | {r['health_max_ms']} | {r['rss_before_mib']} → {r['rss_after_mib']} | {seen} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = attack_parser(__doc__).parse_args()
    server = Server(["--max-model-len", "1024", *args.serve_arg])
    neighbour = Neighbour(server)
    try:
        rows = []
        for attack in ATTACKS:
            if args.only and attack.__name__ not in args.only:
                continue
            rows.append(measure(server, neighbour, attack))
            print(json.dumps(rows[-1]), flush=True)
        grammars = grammar_metrics(server)
    finally:
        neighbour.close()
        server.close()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "label": args.label,
        "commit": commit,
        "serve_args": args.serve_arg,
        "cpus": os.cpu_count(),
        "neighbour_errors": neighbour.errors,
        "neighbour_median_gap_s": round(
            statistics.median(b - a for a, b in zip(neighbour.times, neighbour.times[1:])), 3
        ),
        "rows": rows,
        "grammars": grammars,
    }
    text = (
        table(rows, args.label or commit)
        + f"\n\nNeighbour's median gap over the run: {report['neighbour_median_gap_s']} s."
        + f"\n\nThe engine's grammars over the run (`/metrics`): {json.dumps(grammars)}"
    )
    print(text)
    if args.json:
        save_results(args.json, report, text)


if __name__ == "__main__":
    main()
