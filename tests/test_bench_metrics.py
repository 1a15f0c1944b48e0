"""`bench serve`'s arithmetic on hand-made timings: vLLM's metric definitions and keys, goodput,
percentiles, the arrival schedule, and the streaming client against a scripted server."""

import asyncio
import json

import httpx
import numpy as np
import pytest

from jaxpaged.bench import metrics, serve_client
from jaxpaged.bench.metrics import RequestResult
from jaxpaged.bench.sharegpt import SampleRequest


def _done(prompt_len, tokens, ttft, latency, itl=()):
    return RequestResult(
        prompt_len=prompt_len, success=True, output_tokens=tokens, ttft=ttft, latency=latency, itl=list(itl)
    )


# Four successful requests and one failure, over 2 seconds.
RESULTS = [
    _done(10, 11, ttft=0.100, latency=1.100, itl=[0.1] * 10),  # TPOT (1.1 - 0.1) / 10 = 100 ms
    _done(20, 5, ttft=0.200, latency=0.600, itl=[0.1] * 4),  # TPOT 100 ms
    _done(30, 3, ttft=0.300, latency=0.700, itl=[0.2, 0.2]),  # TPOT 200 ms
    _done(40, 1, ttft=0.400, latency=0.400),  # one token: no TPOT, counts as 0 for goodput
    RequestResult(prompt_len=50, error="HTTP 500: boom"),
]


def summary(**kwargs):
    options = dict(percentile_metrics=list(metrics.METRICS), percentiles=[50.0, 99.0], goodput={})
    return metrics.summarize(RESULTS, 2.0, **{**options, **kwargs})


def test_counts_and_throughputs_use_successful_requests_only():
    s = summary()
    assert (s["completed"], s["failed"]) == (4, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (100, 20)
    assert s["request_throughput"] == 2.0 and s["output_throughput"] == 10.0 and s["total_token_throughput"] == 60.0
    assert s["request_goodput"] is None  # no SLOs given
    assert s["input_lens"] == [10, 20, 30, 40, 50] and s["output_lens"] == [11, 5, 3, 1, 0]
    assert s["errors"] == ["", "", "", "", "HTTP 500: boom"]
    assert len(s["ttfts"]) == len(s["itls"]) == len(s["latencies"]) == 5


def test_latency_statistics_in_milliseconds():
    s = summary()
    assert s["mean_ttft_ms"] == pytest.approx(250.0) and s["median_ttft_ms"] == pytest.approx(250.0)
    assert s["p99_ttft_ms"] == pytest.approx(397.0)  # linear interpolation between 300 and 400
    assert s["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300, 400]))
    assert s["mean_tpot_ms"] == pytest.approx(400 / 3)  # 100, 100, 200: the one-token request has none
    assert s["p50_tpot_ms"] == pytest.approx(100.0)
    assert s["mean_itl_ms"] == pytest.approx((14 * 100 + 2 * 200) / 16)  # every gap of every request
    assert s["median_e2el_ms"] == pytest.approx(650.0) and s["p99_e2el_ms"] == pytest.approx(700 + 0.97 * 400)


def test_only_the_chosen_metrics_and_percentiles_are_reported():
    s = summary(percentile_metrics=["ttft", "e2el"], percentiles=[90.0, 99.9])
    assert "p90_ttft_ms" in s and "p99.9_e2el_ms" in s and "p99_ttft_ms" not in s
    assert not any(k.endswith("_tpot_ms") or k.endswith("_itl_ms") for k in s)
    assert (s["percentile_metrics"], s["metric_percentiles"]) == ("ttft,e2el", "90,99.9")


@pytest.mark.parametrize(
    "slos, good",
    [
        ({"ttft": 250.0}, 2),  # 100 and 200 ms
        ({"ttft": 400.0}, 4),  # the bound is inclusive
        ({"tpot": 150.0}, 3),  # 100, 100 and the one-token request's 0
        ({"ttft": 350.0, "tpot": 150.0}, 2),  # both must hold: requests 1 and 2
        ({"e2el": 650.0}, 2),  # 600 and 400 ms
        ({"ttft": 50.0}, 0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    assert summary(goodput=slos)["request_goodput"] == good / 2.0


def test_no_successful_request_reports_zeros():
    s = metrics.summarize(
        [RequestResult(prompt_len=5, error="x")], 1.0, percentile_metrics=["ttft"], percentiles=[99.0], goodput={}
    )
    assert s["completed"] == 0 and s["failed"] == 1 and s["mean_ttft_ms"] == 0.0


def test_flag_parsers_name_the_flag():
    assert metrics.parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert metrics.parse_goodput(None) == {}
    for bad, message in (
        (["ttft"], "write METRIC:MILLISECONDS"),
        (["itl:5"], "must be one of ttft, tpot, e2el"),
        (["ttft:-1"], "non-negative"),
        (["ttft:nan"], "non-negative"),
    ):
        with pytest.raises(ValueError, match=message):
            metrics.parse_goodput(bad)
    assert metrics.parse_percentile_metrics("ttft, e2el") == ["ttft", "e2el"]
    with pytest.raises(ValueError, match="--percentile-metrics 'ttft,latency'"):
        metrics.parse_percentile_metrics("ttft,latency")
    assert metrics.parse_metric_percentiles("50,99.9") == [50.0, 99.9]
    for bad in ("101", "x", ""):
        with pytest.raises(ValueError, match="--metric-percentiles"):
            metrics.parse_metric_percentiles(bad)


def test_arrivals_poisson_gamma_and_all_at_once():
    assert serve_client.arrival_times(5, float("inf"), 1.0, seed=0) == [0.0] * 5
    times = serve_client.arrival_times(200, 4.0, 1.0, seed=0)
    assert times == serve_client.arrival_times(200, 4.0, 1.0, seed=0)  # seeded
    assert times != serve_client.arrival_times(200, 4.0, 1.0, seed=1)
    assert all(b >= a for a, b in zip(times, times[1:])) and times[-1] == pytest.approx(50.0)  # N / rate
    gaps = np.diff(times)
    assert 0.7 < gaps.std() / gaps.mean() < 1.3  # exponential gaps: coefficient of variation 1
    even = np.diff(serve_client.arrival_times(200, 4.0, 1000.0, seed=0))
    bursty = np.diff(serve_client.arrival_times(200, 4.0, 0.1, seed=0))
    assert even.std() / even.mean() < 0.1 and bursty.std() / bursty.mean() > 2


def test_request_bodies():
    ids = SampleRequest([5, 6, 7], 16)
    text = SampleRequest([0, 9], 8, prompt="Hello")
    body = serve_client.request_body(ids, model="m", chat=False, ignore_eos=True, temperature=None)
    assert body["prompt"] == [5, 6, 7] and body["max_tokens"] == 16 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and "temperature" not in body
    body = serve_client.request_body(text, model="m", chat=True, ignore_eos=False, temperature=0.0)
    assert body["messages"] == [{"role": "user", "content": "Hello"}] and body["max_completion_tokens"] == 8
    assert body["temperature"] == 0.0 and "ignore_eos" not in body and "prompt" not in body


def _stream(*events, done=True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def _send(handler) -> RequestResult:
    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await serve_client.send_request(client, "http://server/v1/completions", {"prompt": "x"}, 7)

    return asyncio.run(main())


def test_streaming_client_times_chunks_and_reads_usage():
    chunks = [{"choices": [{"text": t}]} for t in ("In", " the", " beginning")]
    result = _send(
        lambda request: httpx.Response(
            200, content=_stream(*chunks, {"choices": [], "usage": {"completion_tokens": 5}})
        )
    )
    assert result.success and result.error == "" and result.prompt_len == 7
    assert result.generated_text == "In the beginning" and result.output_tokens == 5  # the server's count
    assert len(result.itl) == 2 and 0 < result.ttft <= result.latency
    chat = [{"choices": [{"delta": {"content": t}}]} for t in ("a", "b")]
    result = _send(lambda request: httpx.Response(200, content=_stream(*chat)))
    assert result.success and result.generated_text == "ab" and result.output_tokens == 2  # no usage: the chunks


@pytest.mark.parametrize(
    "response, error",
    [
        (httpx.Response(503, text="busy"), "HTTP 503: busy"),
        (httpx.Response(200, content=_stream({"choices": [{"text": "a"}]}, done=False)), "ended before [DONE]"),
        (httpx.Response(200, content=_stream({"error": {"message": "engine died"}})), "engine died"),
        (httpx.Response(200, content=_stream()), "carried no tokens"),
    ],
)
def test_streaming_client_reports_failures(response, error):
    result = _send(lambda request: response)
    assert not result.success and error in result.error
