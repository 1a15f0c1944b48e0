"""The load generator of `jaxpaged bench serve`: streaming OpenAI requests sent on a Poisson
(or gamma) schedule with an optional concurrency cap. httpx and asyncio only: no JAX, so it
benchmarks any OpenAI-compatible server.

1. `arrival_times` draws every request's send time up front (seeded): gaps from a gamma
   distribution of shape `burstiness` and mean 1/rate (burstiness 1 is a Poisson process),
   rescaled so the last request goes out at N/rate, as vLLM does; rate inf sends all at once.
2. `run_requests` starts each request at its time; a semaphore holds at most `max_concurrency`
   in flight; a progress bar counts finished requests.
3. `send_request` streams one completion and times the first chunk (TTFT), every later chunk
   (ITL) and the end (E2EL); the output token count is the server's `usage` when it sends one.
"""

import asyncio
import json
import time

import httpx
import numpy as np
from tqdm import tqdm

from jaxpaged.bench.metrics import RequestResult
from jaxpaged.bench.sharegpt import SampleRequest


def arrival_times(num_requests: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).gamma(
        shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests
    )
    times = np.cumsum(gaps)
    return (times * (num_requests / request_rate) / times[-1]).tolist()


def request_body(
    request: SampleRequest, *, model: str, chat: bool, ignore_eos: bool, temperature: float | None
) -> dict:
    """The JSON body of one streaming request: token-id prompts go to completions as ids, text
    prompts as text (or as one user message for a chat endpoint)."""
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}}
    if chat:
        body.update(messages=[{"role": "user", "content": request.prompt}], max_completion_tokens=request.output_len)
    else:
        body.update(
            prompt=request.prompt if request.prompt is not None else request.prompt_token_ids,
            max_tokens=request.output_len,
        )
    if ignore_eos:
        body["ignore_eos"] = True
    if temperature is not None:
        body["temperature"] = temperature
    return body


async def send_request(client: httpx.AsyncClient, url: str, body: dict, prompt_len: int) -> RequestResult:
    """Streams one request and times it; any failure is a result with `error` set, never raised."""
    result = RequestResult(prompt_len=prompt_len, start_time=time.time())
    start = last = time.perf_counter()
    chunks, text, usage_tokens, finished = 0, [], None, False
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:500]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    finished = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = json.dumps(event["error"])[:500]
                    return result
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                if event.get("choices"):
                    now = time.perf_counter()
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    choice = event["choices"][0]
                    text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        result.error = f"{type(err).__name__}: {err}"
        return result
    result.latency = time.perf_counter() - start
    if not finished or chunks == 0:
        result.error = "the stream ended before [DONE]" if not finished else "the stream carried no tokens"
        return result
    result.success, result.generated_text = True, "".join(text)
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    return result


async def run_requests(
    client: httpx.AsyncClient,
    url: str,
    bodies: list[dict],
    prompt_lens: list[int],
    send_at: list[float],
    max_concurrency: int | None,
    show_progress: bool,
) -> tuple[list[RequestResult], float]:
    """Sends every request at its time (at most `max_concurrency` in flight); returns the results
    in request order and the benchmark's duration in seconds."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(bodies), desc="requests", disable=not show_progress)
    start = time.perf_counter()

    async def one(body: dict, prompt_len: int, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        if gate is None:
            result = await send_request(client, url, body, prompt_len)
        else:
            async with gate:
                result = await send_request(client, url, body, prompt_len)
        bar.update()
        return result

    results = await asyncio.gather(*(one(b, n, at) for b, n, at in zip(bodies, prompt_lens, send_at)))
    duration = time.perf_counter() - start
    bar.close()
    return list(results), duration
