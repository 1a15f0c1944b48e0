"""Fuzzes the OpenAI-compatible server over real HTTP on 127.0.0.1: no client input may get a 5xx
or a dropped connection.

The server runs in-process (uvicorn on a thread) over the bundled demo model, so the test needs no
torch. `fuzz_requests.generate_cases` draws a fixed set (seeded) of hostile requests: wrong types
for every field, out-of-range and non-finite numbers, lone surrogates, invalid UTF-8, bodies over
the 4 MiB cap, deep nesting, odd content types, bad API keys, plus about 10% valid requests. Every
answer must be 200 or 4xx; every non-200 must be OpenAI's error JSON with a message free of Python
internals; a 200 to `"stream": true` must be SSE ending in `data: [DONE]`. Failures are collected
and reported together (distinct cases, compactly). Afterwards the engine must still serve and go
idle. Set JAXPAGED_FUZZ_SEED / JAXPAGED_FUZZ_SCALE to explore other draws.
"""

import collections
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import fuzz_requests
import httpx
import pytest
from fuzz_requests import API_KEY, MODEL, Case

SEED = int(os.environ.get("JAXPAGED_FUZZ_SEED", "20250101"))
SCALE = float(os.environ.get("JAXPAGED_FUZZ_SCALE", "1"))
WORKERS = 4  # concurrent clients: valid requests batch in the engine while bad ones are answered
TIMEOUT = 30.0  # seconds per request (unless the case says); no answer in time is a failure
AUTH = {"authorization": f"Bearer {API_KEY}"}
ERROR_KEYS = {"message": str, "type": str, "param": (str, type(None)), "code": (str, type(None))}
# Python internals that must never reach a client
LEAKS = re.compile(
    r"Traceback|object at 0x|File \"|<class |\b\w*(Error|Exception)\b|"
    r"validation errors? for \w+|errors\.pydantic\.dev"
)  # the last two: str(pydantic.ValidationError)
ALLOWED_WORDS = {"error", "exception"}  # the plain words are fine; class names are not
MAX_ERROR_BYTES = 2048  # an error answer's size bound, whatever the size of the request


@pytest.fixture(scope="module")
def server(demo_server):
    """The session's demo engine behind this module's app (its API key). Idle keep-alive
    connections stay open for the whole run: uvicorn closing one (after 5 s by default) just as a
    client reuses it resets that request, whatever its input."""
    served = demo_server.serve(MODEL, dict(log_level="critical", timeout_keep_alive=600), api_key=API_KEY)
    yield served
    served.close()


def fuzz_client(server) -> "httpx.Client":
    return httpx.Client(base_url=server.url, trust_env=False, timeout=TIMEOUT)


def _leak(message: str) -> str | None:
    for m in LEAKS.finditer(message):
        if m.group(0).lower() not in ALLOWED_WORDS:
            return m.group(0)
    return None


def check_error_body(response: "httpx.Response") -> str | None:
    """None if `response` is OpenAI's error JSON with a clean message, else what is wrong."""
    ctype = response.headers.get("content-type", "")
    if not ctype.startswith("application/json"):
        return f"error content-type {ctype!r}"
    try:
        body = json.loads(response.content)
    except ValueError:
        return "error body is not JSON"
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return "error body is not {'error': {...}}"
    err = body["error"]
    for key, types in ERROR_KEYS.items():
        if key not in err:
            return f"error lacks {key!r}"
        if not isinstance(err[key], types):
            return f"error.{key} is {type(err[key]).__name__}"
    leak = _leak(err["message"])
    if leak:
        return f"message leaks {leak!r}"
    return None


def check_ok_body(case: Case, response: "httpx.Response") -> str | None:
    """None if a 200 answer is well formed for its endpoint, else what is wrong."""
    ctype = response.headers.get("content-type", "")
    path = response.request.url.path
    if ctype.startswith("text/event-stream"):
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return "SSE from a non-generation route"
        events = [line[len("data:") :].strip() for line in response.text.split("\n") if line.startswith("data:")]
        if not events or events[-1] != "[DONE]":
            return f"SSE does not end in [DONE] (last {events[-1][:60] if events else None!r})"
        for event in events[:-1]:
            try:
                chunk = json.loads(event)
            except ValueError:
                return f"SSE event is not JSON: {event[:60]!r}"
            if "error" in chunk:
                return f"SSE error event: {event[:100]}"
        return None
    if case.stream:
        return f"stream requested, got {ctype!r}"
    if path == "/health":
        return None
    if path == "/metrics":
        return None if ctype.startswith("text/plain") else f"metrics content-type {ctype!r}"
    if not ctype.startswith("application/json"):
        return f"200 content-type {ctype!r}"
    try:
        body = json.loads(response.content)
    except ValueError:
        return "200 body is not JSON"
    generated = path in ("/v1/completions", "/v1/chat/completions")
    if generated and (not isinstance(body, dict) or not isinstance(body.get("choices"), list) or not body["choices"]):
        return "200 completion without choices"
    return None


def send(client: "httpx.Client", case: Case) -> "tuple[httpx.Response | str, bytes, float]":
    """Sends one case: (the response, or what went wrong instead; the body; seconds)."""
    start = time.perf_counter()
    content = case.body
    if case.chunked and content is not None:
        data = content
        content = (data[i : i + 65536] for i in range(0, len(data), 65536))
    timeout = case.timeout or TIMEOUT
    try:
        response = client.request(case.method, case.path, content=content, headers=case.headers, timeout=timeout)
    except httpx.LocalProtocolError as err:  # the client refused to send it: a bug in the generator
        return f"client refused: {err}", b"", time.perf_counter() - start
    except httpx.TimeoutException as err:
        return f"no answer in {timeout:.0f}s ({type(err).__name__})", b"", time.perf_counter() - start
    except httpx.TransportError as err:
        return f"connection dropped ({type(err).__name__}: {err})", b"", time.perf_counter() - start
    return response, response.content, time.perf_counter() - start


def judge(case: Case, result) -> str | None:
    """None if the answer is acceptable, else the problem."""
    if not isinstance(result, httpx.Response):
        return result
    status = result.status_code
    if status >= 500:
        return "5xx"
    if not (status == 200 or 400 <= status < 500):
        return f"status {status} is neither 200 nor 4xx"
    if case.expect is not None and status != case.expect:
        return f"expected {case.expect}"
    if status == 200:
        return check_ok_body(case, result)
    if len(result.content) > MAX_ERROR_BYTES:
        return f"a {len(result.content)}-byte error answer"
    return check_error_body(result)


def metric(client: "httpx.Client", name: str) -> float | None:
    text = client.get("/metrics", headers=AUTH).text
    m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def test_no_input_gets_5xx_or_a_dropped_connection(server):
    cases = fuzz_requests.generate_cases(SEED, SCALE)
    local = threading.local()
    records = []  # (order, case, status or "none", body head, problem or None, seconds, start offset)
    lock = threading.Lock()
    order = iter(range(10**9))
    started = time.perf_counter()

    clients = []

    def run(case: Case) -> None:
        if not hasattr(local, "client"):
            local.client = fuzz_client(server)
            with lock:
                clients.append(local.client)
        t0 = time.perf_counter() - started
        result, body, seconds = send(local.client, case)
        problem = judge(case, result)
        status = result.status_code if isinstance(result, httpx.Response) else "none"
        head = body[:120].decode("utf-8", "replace")
        with lock:
            records.append((next(order), case, status, head, problem, seconds, t0))

    with ThreadPoolExecutor(WORKERS) as pool:
        list(pool.map(run, cases))
    fuzz_seconds = time.perf_counter() - started
    for client in clients:
        client.close()

    # afterwards: a plain request still works and the engine goes idle
    post = []
    with fuzz_client(server) as client:
        ok = client.post("/v1/completions", headers=AUTH, json={"model": MODEL, "prompt": "and the", "max_tokens": 4})
        if ok.status_code != 200 or not ok.json().get("choices"):
            post.append(f"completion after fuzzing: {ok.status_code} {ok.text[:120]}")
        health = client.get("/health")
        if health.status_code != 200:
            post.append(f"/health after fuzzing: {health.status_code} {health.text[:120]}")
        gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
        deadline = time.time() + 10
        while True:
            values = {g: metric(client, g) for g in gauges}
            if all(v == 0 for v in values.values()) or time.time() > deadline:
                break
            time.sleep(0.1)
        if not all(v == 0 for v in values.values()):
            post.append(f"engine not idle 10 s after fuzzing: {values}")

    # report
    by_endpoint = collections.Counter(case.endpoint for _, case, *_ in records)
    statuses = collections.Counter(str(status) for _, _, status, *_ in records)
    per_endpoint_status = collections.defaultdict(collections.Counter)
    for _, case, status, *_ in records:
        per_endpoint_status[case.endpoint][str(status)] += 1
    slowest = sorted(records, key=lambda r: -r[5])[:10]
    print(
        f"\nfuzz: {len(records)} requests in {fuzz_seconds:.1f}s (seed {SEED}, {WORKERS} clients), "
        f"statuses {dict(sorted(statuses.items()))}"
    )
    for endpoint in sorted(by_endpoint):
        print(f"  {endpoint:12s} {by_endpoint[endpoint]:4d}  {dict(sorted(per_endpoint_status[endpoint].items()))}")
    print("  slowest: " + "; ".join(f"{r[1].desc[:50]} {r[5]:.2f}s" for r in slowest))

    if os.environ.get("JAXPAGED_FUZZ_LOG"):  # every request, for digging into a failure
        with open(os.environ["JAXPAGED_FUZZ_LOG"], "w") as f:
            for _, case, status, head, problem, seconds, t0 in sorted(records, key=lambda r: r[6]):
                f.write(
                    json.dumps(
                        {
                            "t": round(t0, 3),
                            "s": round(seconds, 3),
                            "endpoint": case.endpoint,
                            "status": status,
                            "problem": problem,
                            "desc": case.desc,
                            "head": head,
                        }
                    )
                    + "\n"
                )

    failures = sorted((r for r in records if r[4]), key=lambda r: r[0])
    distinct, seen = [], set()
    for _, case, status, head, problem, *_ in failures:
        key = (case.endpoint, status, problem, case.desc)
        if key not in seen:
            seen.add(key)
            distinct.append(f"({case.endpoint}, {status}, {problem}, {head!r}, {case.method} {case.path}: {case.desc})")
    if distinct:
        print(f"fuzz: {len(failures)} failing requests, {len(distinct)} distinct:")
        for line in distinct:
            print("  " + line)
    for line in post:
        print("fuzz post-check: " + line)

    assert len(records) == len(cases) >= 500
    for endpoint in ("completions", "chat", "tokenize", "detokenize", "models", "health", "auth"):
        assert by_endpoint[endpoint] >= 20, f"only {by_endpoint[endpoint]} {endpoint} requests"
    assert sum(by_endpoint.values()) == sum(statuses.values()) == len(records)
    summary = "\n".join(distinct[:30]) + (f"\n... and {len(distinct) - 30} more" if len(distinct) > 30 else "")
    assert not distinct and not post, (
        f"{len(failures)} of {len(records)} requests failed ({len(distinct)} distinct), statuses "
        f"{dict(sorted(statuses.items()))}\n{summary}\n" + "\n".join(post)
    )
