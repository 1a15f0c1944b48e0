"""The OpenAI-compatible server over real HTTP on 127.0.0.1 (in-process uvicorn, and `jaxpaged serve`).

References come from `LLM.generate` / `LLM.chat` on the same engine before the server takes it
over, so greedy server output must equal them exactly. Disconnect tests hold or slow the engine
thread (a gate around `LLMEngine.step`) so that the request is certainly still running.
"""

import asyncio
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
from engine_fixtures import make_model_dir  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from jaxpaged.engine.llm_engine import LLMEngine  # noqa: E402
from jaxpaged.entrypoints.llm import LLM  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402
from jaxpaged.server.app import build_app  # noqa: E402
from jaxpaged.server.async_engine import AsyncEngine, EngineDeadError  # noqa: E402

MODEL = "tiny-llama"
PROMPTS = [f"the quick brown fox number {i} jumps" for i in range(64)]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the lazy dog"}]
MAX_TOKENS = 10


class Server:
    """A running server and the references computed before it started."""

    def __init__(self, llm: LLM):
        greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        self.refs = {o.prompt: o.outputs[0].text for o in llm.generate(PROMPTS, greedy, use_tqdm=False)}
        self.chat_ref = llm.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0].text
        self.empty_ref = llm.generate([""], greedy, use_tqdm=False)[0]
        self.engine = llm.llm_engine  # from here on only the AsyncEngine thread calls it
        self.gate, self.delay = threading.Event(), 0.0
        self.gate.set()
        step = self.engine.step

        def gated_step():
            self.gate.wait(30)
            time.sleep(self.delay)
            return step()

        self.engine.step = gated_step
        self.async_engine = AsyncEngine(self.engine)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(build_app(self.async_engine, MODEL), log_level="warning"))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uvicorn.started and time.time() < deadline:
            time.sleep(0.02)
        assert self.uvicorn.started
        self.http = httpx.Client(base_url=self.url, trust_env=False, timeout=60)
        self.client = openai.OpenAI(
            base_url=self.url + "/v1",
            api_key="unused",
            max_retries=0,
            http_client=httpx.Client(trust_env=False, timeout=60),
        )

    def close(self):
        self.gate.set()
        self.uvicorn.should_exit = True
        self.thread.join(15)
        self.async_engine.shutdown()

    def metrics(self) -> dict[str, float]:
        """Every sample, keyed by name plus labels other than model_name."""
        samples = {}
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
                samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return samples

    def wait_idle(self, until=lambda m: True, timeout: float = 20) -> dict[str, float]:
        """Polls /metrics until `until(metrics)` holds, nothing runs or waits and the KV cache is
        empty (the gauges are a snapshot of the last step, so `until` should see that step's effect)."""
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
            idle = all(m[g] == 0 for g in gauges)
            if (idle and until(m)) or time.time() > deadline:
                assert idle and until(m), f"engine not idle after {timeout}s: {m}"
                return m
            time.sleep(0.05)


@pytest.fixture(scope="module")
def server(shared_engines):
    srv = Server(shared_engines.take("tiny"))  # the server's shutdown ends the engine: taken, not borrowed
    yield srv
    srv.close()


ABORTS = "vllm:request_success_total{finished_reason=abort}"


def test_completions_match_llm_generate(server):
    prompt = PROMPTS[0]
    out = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == server.refs[prompt] and out.object == "text_completion"
    usage = out.usage
    assert usage.completion_tokens <= MAX_TOKENS and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0

    stream = server.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == server.refs[prompt]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")

    batch = server.client.completions.create(model=MODEL, prompt=PROMPTS[1:4], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [server.refs[p] for p in PROMPTS[1:4]]


def test_a_stream_gets_each_token_as_it_is_sampled(server):
    """A stream's decode steps are not fused (the engine fuses 4 here): one token per chunk, so
    inter-token latency is the step time, as vLLM streams."""
    stream = server.client.completions.create(
        model=MODEL,
        prompt=PROMPTS[5],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert len([c for c in chunks if c.choices]) == chunks[-1].usage.completion_tokens == 12


def test_empty_prompt_is_bos_alone_as_in_generate(server):
    """ "" is the tokenizer's BOS alone, as in `LLM.generate` and `jaxpaged generate ""`."""
    assert server.empty_ref.prompt_token_ids == [1]  # the tiny tokenizer adds BOS (id 1)
    out = server.client.completions.create(model=MODEL, prompt="", max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == server.empty_ref.outputs[0].text and out.usage.prompt_tokens == 1


def test_chat_matches_llm_chat(server):
    out = server.client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == server.chat_ref
    stream = server.client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_completion_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == server.chat_ref
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_logprobs_and_parallel_sampling(server):
    out = server.client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy picks the top token
    comp = server.client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2)
    assert len(comp.choices[0].logprobs.tokens) == len(comp.choices[0].logprobs.top_logprobs)
    many = server.client.completions.create(
        model=MODEL,
        prompt=PROMPTS[:2],
        max_tokens=6,
        n=3,
        temperature=1.0,
        seed=2**40,
        extra_body={"top_k": 10**9, "ignore_eos": True},
    )
    assert sorted(c.index for c in many.choices) == list(range(6)) and many.usage.completion_tokens == 36


def test_64_concurrent_streaming_clients(server):
    async def one(client, prompt):
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main():
        http = httpx.AsyncClient(trust_env=False, timeout=120, limits=httpx.Limits(max_connections=100))
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, http_client=http)
        try:
            return await asyncio.gather(*(one(client, p) for p in PROMPTS))
        finally:
            await http.aclose()

    texts = asyncio.run(main())
    assert texts == [server.refs[p] for p in PROMPTS]
    server.wait_idle()


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    aborts = server.metrics().get(ABORTS, 0)
    body = {"model": MODEL, "prompt": PROMPTS[5], "max_tokens": 100, "ignore_eos": True, "stream": True}
    server.delay = 0.02  # ~100 tokens now take > 0.5 s
    try:
        with server.http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            received = [line for _, line in zip(range(2), filter(None, lines))]
        assert all(line.startswith("data: {") for line in received)
        server.wait_idle(until=lambda m: m.get(ABORTS, 0) == aborts + 1)
    finally:
        server.delay = 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_before_the_first_token_aborts(server, stream):
    aborts = server.metrics().get(ABORTS, 0)
    body = {"model": MODEL, "prompt": PROMPTS[6], "max_tokens": 50, "stream": stream}
    server.gate.clear()  # the engine thread stops at its next step
    try:
        # no answer yet (a stream's status and headers come with its first output): the client
        # gives up and goes away
        with pytest.raises(httpx.ReadTimeout):
            server.http.post("/v1/completions", json=body, timeout=0.5)
        time.sleep(0.2)  # let the server see the disconnect
    finally:
        server.gate.set()
    server.wait_idle(until=lambda m: m.get(ABORTS, 0) == aborts + 1)


BAD = [
    # (path, body or raw bytes, status, substring of the error message)
    ("/v1/completions", b"{not json", 400, "not valid JSON"),
    ("/v1/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt: Field required"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": []}, 400, "prompt must not be empty"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "the prompt is empty (it has no tokens)"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "hi " * 100, "max_tokens": 100}, 400, "maximum context length is 128"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be at least 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens must be at least 1"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature must be non-negative"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n must be at least 1"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}, 400, "at most 16 items are accepted (stop strings"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 5}, 400, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1000}}, 400, "logit_bias values must be numbers"),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413, "exceeds the limit"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages: Field required"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 200}, 400, "maximum context length"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "x"}, 404, "does not exist"),
    ("/detokenize", {"tokens": [100000]}, 400, "outside the vocabulary"),
    ("/no/such/route", {}, 404, "Not Found"),
]


def test_bad_inputs_get_openai_errors_and_the_server_stays_healthy(server):
    for path, body, status, message in BAD:
        if isinstance(body, bytes):
            response = server.http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            response = server.http.post(path, json=body)
        assert response.status_code == status, (path, body if isinstance(body, dict) else body[:40], response.text)
        error = response.json()["error"]
        assert message in error["message"], (body, error)
        assert set(error) == {"message", "type", "param", "code"}
        assert server.http.get("/health").status_code == 200
    chunked = server.http.post(
        "/v1/completions",
        content=iter([b'{"prompt": "'] + [b"a" * 2**20] * 5 + [b'"}']),
        headers={"content-type": "application/json"},
    )  # no Content-Length: counted as it arrives
    assert chunked.status_code == 413 and "exceeds the limit" in chunked.json()["error"]["message"]
    ok = server.http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == server.refs[PROMPTS[0]]
    server.wait_idle()


def test_metrics_parse_and_counters_move(server):
    before = server.metrics()
    out = server.client.completions.create(
        model=MODEL, prompt=PROMPTS[7], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = server.wait_idle(
        until=lambda m: (
            m["vllm:e2e_request_latency_seconds_count"] > before.get("vllm:e2e_request_latency_seconds_count", 0)
        )
    )
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == out.usage.prompt_tokens
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:prefix_cache_queries_total"] >= before["vllm:prefix_cache_queries_total"]
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert after[f"vllm:{name}_count"] == before.get(f"vllm:{name}_count", 0) + 1
    itl = "vllm:inter_token_latency_seconds_count"
    assert after[itl] >= before.get(itl, 0) + 4
    assert "vllm:request_success_total{finished_reason=length}" in after


def test_models_tokenize_detokenize(server):
    [card] = server.client.models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == 128
    tokens = server.http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 128
    text = server.http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith(PROMPTS[0])
    chat = server.http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] > tokens["count"] // 2
    assert server.http.get("/health").status_code == 200
    # the render routes vllm-router asks for a request's prompt tokens (vLLM's names): as /tokenize
    # tokenizes, and as the request would run (truncated, continued), the router's fields accepted
    router_fields = {"stream": False, "echo": False, "no_stop_trim": False, "ignore_eos": False}
    render = server.http.post("/v1/completions/render", json={"prompt": [PROMPTS[0], PROMPTS[1]], **router_fields})
    assert [r["token_ids"] for r in render.json()][0] == tokens["tokens"] and len(render.json()) == 2
    body = {"prompt": PROMPTS[0], "truncate_prompt_tokens": 3, **router_fields}
    assert server.http.post("/v1/completions/render", json=body).json() == [{"token_ids": tokens["tokens"][-3:]}]
    rendered = server.http.post("/v1/chat/completions/render", json={"messages": CHAT, **router_fields}).json()
    assert rendered == {"token_ids": chat["tokens"]}
    tail = [*CHAT, {"role": "assistant", "content": "In the"}]
    continued = server.http.post("/tokenize", json={"messages": tail, "continue_final_message": False}).json()
    open_turn = server.http.post("/tokenize", json={"messages": tail, "continue_final_message": True}).json()
    assert open_turn["tokens"] != continued["tokens"]
    assert server.http.post("/v1/chat/completions/render", json={"messages": CHAT, "model": "nope"}).status_code == 404


def test_async_engine_generate_and_errors(server):
    engine = server.async_engine
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)

    async def main():
        text = "".join([o.outputs[0].text async for o in engine.generate(PROMPTS[3], greedy, "direct-1")])
        with pytest.raises(ValueError, match="empty"):
            await engine.add_requests(["direct-2"], [{"prompt_token_ids": []}], greedy)
        with pytest.raises(ValueError, match="already in use"):  # all or nothing: neither stays queued
            await engine.add_requests(["direct-3", "direct-3"], [PROMPTS[0], PROMPTS[1]], greedy)
        return text

    assert asyncio.run(main()) == server.refs[PROMPTS[3]]
    server.wait_idle()


class _BrokenEngine(LLMEngine):
    """Just enough of an `LLMEngine` for `AsyncEngine` (nothing compiled), with a step that fails."""

    def __init__(self, model_dir: str):  # no super().__init__: no model, no cache
        self.config = types.SimpleNamespace(
            model=types.SimpleNamespace(vocab_size=512),
            max_model_len=128,
            load=types.SimpleNamespace(model=model_dir, tokenizer=None),
            scheduling=types.SimpleNamespace(max_num_seqs=4),
        )
        self.tokenizer = None

    def get_stats(self):
        return {}

    def add_request(self, request_id, prompt, params, **kwargs):
        pass

    def abort_request(self, request_id):
        pass

    def has_unfinished_requests(self):
        return True

    def step(self):
        raise RuntimeError("device on fire")


def test_a_failing_step_stops_the_engine_and_fails_requests_cleanly(server):
    deaths = []
    engine = AsyncEngine(_BrokenEngine(server.engine.config.load.model), on_dead=deaths.append)
    app = build_app(engine, MODEL)

    async def main():
        stream = await engine.add_requests(["r"], [{"prompt_token_ids": [1, 2]}], SamplingParams())
        with pytest.raises(EngineDeadError, match=r"the engine loop failed \(RuntimeError\)"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_requests(["s"], ["hi"], SamplingParams())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as http:
            health = await http.get("/health")
            assert health.status_code == 503 and health.json()["error"]["message"] == "not ready: dead"
            assert (await http.get("/live")).status_code == 200
            response = await http.post("/v1/completions", json={"prompt": "hi"})
            assert response.status_code == 503 and response.json()["error"]["message"] == "the engine is not running"
            assert "device on fire" not in health.text + response.text  # no internals to clients

    asyncio.run(main())
    assert not engine.is_running and len(deaths) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_jaxpaged_serve_with_api_key(server, tmp_path):
    model_dir = server.engine.config.load.model
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "jaxpaged.cli",
        "serve",
        model_dir,
        "--port",
        str(port),
        "--api-key",
        "sk-test",
        "--served-model-name",
        "tiny",
        "--dtype",
        "float32",
        "--max-model-len",
        "64",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "16",
        "--uvicorn-log-level",
        "warning",
    ]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, trust_env=False, timeout=30)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, open(tmp_path / "serve.log").read()
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, "jaxpaged serve did not start"
            time.sleep(0.25)
        assert http.get("/v1/models").status_code == 401
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        assert http.get("/metrics").status_code == 200  # Prometheus scrapes without the key, as in vLLM
        assert http.get("/v1/models", headers={"Authorization": "Bearer sk-test"}).json()["data"][0]["id"] == "tiny"
        client = openai.OpenAI(
            base_url=url + "/v1",
            api_key="sk-test",
            max_retries=0,
            http_client=httpx.Client(trust_env=False, timeout=30),
        )
        out = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
        assert out.choices[0].text == server.refs[PROMPTS[0]]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=url + "/v1", api_key="bad", max_retries=0, http_client=httpx.Client(trust_env=False)
            ).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    text = open(tmp_path / "serve.log").read()
    assert code == 0, text
    for expected in ("engine ready", "compiled in", f"http://127.0.0.1:{port}/v1", "dtype float32"):
        assert expected in text, text
    assert re.search(r"KV cache \d+ blocks x 16 = \d+ tokens", text), text
    assert PROMPTS[0] not in text  # request logs carry no prompt text


def test_enable_log_requests_logs_prompts_only_when_asked(server, caplog):
    async def ask(log_prompts: bool):
        app = build_app(server.async_engine, MODEL, log_prompts=log_prompts)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 2, "temperature": 0}
            assert (await http.post("/v1/completions", json=body)).status_code == 200

    with caplog.at_level(logging.INFO, logger="jaxpaged.server"):
        asyncio.run(ask(False))
        assert PROMPTS[2] not in caplog.text
        asyncio.run(ask(True))
        assert PROMPTS[2] in caplog.text
    server.wait_idle()


def test_host_and_disk_tier_metrics_and_start_up_log(tmp_path, caplog):
    """With --kv-offloading-size (and --kv-cache-dir) /metrics adds the tiers' hits (vLLM's
    external prefix-cache names) and traffic, and start-up logs their sizes."""
    from jaxpaged.server.metrics import ServerMetrics

    make_model_dir(str(tmp_path))
    block_bytes = 2 * 2 * 2 * 16 * 4 * 16  # K and V x layers x kv heads x head_dim x float32 x tokens
    # 6 usable blocks: two requests of 3 blocks at a time, so the next two evict the first two's
    with caplog.at_level(logging.INFO, logger="jaxpaged"):
        llm = LLM(
            str(tmp_path),
            dtype="float32",
            max_model_len=64,
            max_num_seqs=2,
            max_num_batched_tokens=64,
            kv_cache_memory_bytes=7 * block_bytes,
            kv_offloading_size=64 * block_bytes / 2**30,
            kv_cache_dir=str(tmp_path / "kv"),
            kv_cache_dir_size=1.0,
        )
    assert "host KV tier: 64 blocks x 16 tokens = 1024 tokens (512.00 KiB of host memory)" in caplog.text
    assert "preemption by swap" in caplog.text
    assert "disk KV tier: " in caplog.text and "up to 1.00 GiB" in caplog.text
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i] * 40} for i in range(4)]
    first = llm.generate(prompts, greedy, use_tqdm=False)
    again = llm.generate(prompts[:1], greedy, use_tqdm=False)  # its blocks were evicted: host hits
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
    llm.llm_engine.disk_tier.flush()  # its writes are on disk before the stats snapshot
    engine = AsyncEngine(llm.llm_engine)
    try:
        text = ServerMetrics(engine, MODEL).render()[0].decode()
    finally:
        engine.shutdown()
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["vllm:external_prefix_cache_hits_total"] >= 32
    assert samples["vllm:external_prefix_cache_queries_total"] >= samples["vllm:external_prefix_cache_hits_total"]
    assert samples["jaxpaged:kv_offload_bytes_total"] >= 2 * block_bytes
    assert samples["jaxpaged:kv_load_bytes_total"] >= 2 * block_bytes
    assert samples["jaxpaged:kv_host_tier_blocks"] == 64
    for name in (
        "jaxpaged:kv_swapped_out_blocks_total",
        "jaxpaged:kv_host_tier_swapped_blocks",
        "jaxpaged:kv_disk_hit_tokens_total",
        "jaxpaged:kv_disk_rejected_files_total",
    ):
        assert name in samples
    assert samples["jaxpaged:kv_disk_write_bytes_total"] > 0 and samples["jaxpaged:kv_disk_blocks"] > 0
