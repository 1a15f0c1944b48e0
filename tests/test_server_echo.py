"""`/v1/completions` with `echo` + `logprobs` (the request lm-eval's `local-completions` sends for
every log-likelihood task), `max_tokens: 0` with echo, streaming with echo, vLLM's
`prompt_logprobs`, and `logit_bias`; references come from the same engine's `prompt_logprobs`
before the server takes it over."""

import json

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
import test_server  # noqa: E402

from jaxpaged.sampling_params import SamplingParams  # noqa: E402

PROMPT = [5, 77, 300, 12, 9, 250, 31, 404, 18, 66] * 8  # 80 tokens: two prefill chunks of 64
TEXT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server(shared_engines):
    llm = shared_engines.take("tiny")  # the server's shutdown ends the engine: taken, not borrowed
    scored = SamplingParams(temperature=0, max_tokens=1, logprobs=1, prompt_logprobs=1)
    refs = {"ids": llm.generate([{"prompt_token_ids": PROMPT}], scored, use_tqdm=False)[0]}
    refs["text"] = llm.generate([TEXT], scored, use_tqdm=False)[0]
    srv = test_server.Server(llm)
    srv.scored = refs
    yield srv
    srv.close()


def lm_eval_request(prompt, **extra) -> dict:
    """What lm-eval 0.4.13's `local-completions` sends to score a continuation."""
    return {"prompt": [prompt], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0, "seed": 1234, **extra}


def check_echoed_logprobs(logprobs: dict, ref, num_prompt: int) -> None:
    """The logprobs object covers the prompt (first entry null) and then the generated token, with
    the engine's prompt logprobs; greediness can be read off `top_logprobs` as lm-eval does."""
    token_logprobs, tops = logprobs["token_logprobs"], logprobs["top_logprobs"]
    assert len(token_logprobs) == len(tops) == len(logprobs["tokens"]) == len(logprobs["text_offset"])
    assert token_logprobs[0] is None and tops[0] is None
    for j in range(1, num_prompt):
        token = ref.prompt_token_ids[j]
        assert token_logprobs[j] == pytest.approx(ref.prompt_logprobs[j][token].logprob, abs=1e-6)
        assert len(tops[j]) == 1
        greedy = ref.prompt_logprobs[j][token].rank == 1
        assert (token_logprobs[j] == max(tops[j].values())) == greedy
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


def test_lm_eval_loglikelihood_request(server):
    response = server.http.post("/v1/completions", json=lm_eval_request(PROMPT))
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    ref = server.scored["ids"]
    logprobs = choice["logprobs"]
    assert len(logprobs["token_logprobs"]) == len(PROMPT) + 1  # the prompt, then the generated token
    check_echoed_logprobs(logprobs, ref, len(PROMPT))
    generated = ref.outputs[0]
    assert logprobs["token_logprobs"][-1] == pytest.approx(generated.logprobs[0][generated.token_ids[0]].logprob)
    # lm-eval: sum over the continuation's tokens (here the last 5 of the prompt), the generated one dropped
    total = sum(logprobs["token_logprobs"][len(PROMPT) - 5 : -1])
    expected = sum(ref.prompt_logprobs[j][PROMPT[j]].logprob for j in range(len(PROMPT) - 5, len(PROMPT)))
    assert total == pytest.approx(expected, abs=1e-5)
    assert choice["text"].startswith(server.engine.tokenizer.decode(PROMPT))
    assert choice["text"] == server.engine.tokenizer.decode(PROMPT) + generated.text


def test_echo_with_max_tokens_0_returns_the_prompt_alone(server):
    response = server.http.post("/v1/completions", json={**lm_eval_request(TEXT), "prompt": TEXT, "max_tokens": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    [choice] = body["choices"]
    ref = server.scored["text"]
    assert choice["text"] == TEXT
    assert len(choice["logprobs"]["token_logprobs"]) == len(ref.prompt_token_ids)
    check_echoed_logprobs(choice["logprobs"], ref, len(ref.prompt_token_ids))
    assert body["usage"]["completion_tokens"] == 0
    # echo without logprobs: the prompt in front, no logprobs
    plain = server.http.post("/v1/completions", json={"prompt": TEXT, "echo": True, "max_tokens": 3, "temperature": 0})
    [choice] = plain.json()["choices"]
    assert choice["text"].startswith(TEXT) and choice["logprobs"] is None


def test_streaming_echo_sends_the_prompt_first(server):
    whole = server.http.post("/v1/completions", json=lm_eval_request(TEXT, max_tokens=4)).json()["choices"][0]
    chunks = []
    with server.http.stream("POST", "/v1/completions", json=lm_eval_request(TEXT, max_tokens=4, stream=True)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    assert chunks[0]["text"].startswith(TEXT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed = [lp for c in chunks for lp in c["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]
    assert chunks[-1]["finish_reason"] == "length"
    # max_tokens 0, streamed: the prompt alone
    with server.http.stream("POST", "/v1/completions", json=lm_eval_request(TEXT, max_tokens=0, stream=True)) as r:
        chunks = [json.loads(x[6:])["choices"][0] for x in r.iter_lines() if x.startswith("data: {")]
    assert "".join(c["text"] for c in chunks) == TEXT
    assert len([lp for c in chunks for lp in c["logprobs"]["token_logprobs"]]) == len(
        server.scored["text"].prompt_token_ids
    )


def test_echo_with_n_and_the_openai_client(server):
    out = server.client.completions.create(
        model=test_server.MODEL, prompt=TEXT, echo=True, logprobs=2, max_tokens=3, n=2, temperature=1.0, seed=3
    )
    ref = server.scored["text"]
    for choice in out.choices:
        assert choice.text.startswith(TEXT)
        assert choice.logprobs.token_logprobs[0] is None
        assert len(choice.logprobs.token_logprobs) == len(ref.prompt_token_ids) + 3
        for j in range(1, len(ref.prompt_token_ids)):
            token = ref.prompt_token_ids[j]
            assert choice.logprobs.token_logprobs[j] == pytest.approx(ref.prompt_logprobs[j][token].logprob, abs=1e-6)


def test_prompt_logprobs_field(server):
    body = server.http.post(
        "/v1/completions", json={"prompt": TEXT, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
    ).json()
    entries = body["choices"][0]["prompt_logprobs"]
    ref = server.scored["text"]
    assert entries[0] is None and len(entries) == len(ref.prompt_token_ids)
    for j in range(1, len(entries)):
        token = ref.prompt_token_ids[j]
        assert entries[j][str(token)]["logprob"] == pytest.approx(ref.prompt_logprobs[j][token].logprob, abs=1e-6)
        assert entries[j][str(token)]["rank"] == ref.prompt_logprobs[j][token].rank
    refused = server.http.post("/v1/completions", json={"prompt": TEXT, "prompt_logprobs": 1, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"


def test_logit_bias(server):
    forced = server.http.post(
        "/v1/completions", json={"prompt": TEXT, "max_tokens": 4, "temperature": 0, "logit_bias": {"42": 100}}
    ).json()
    assert forced["choices"][0]["text"] == server.engine.tokenizer.decode([42] * 4)
    chat = server.client.chat.completions.create(
        model=test_server.MODEL,
        messages=test_server.CHAT,
        max_tokens=3,
        temperature=0,
        logit_bias={"42": 100},
        logprobs=True,
    )
    assert [c.token for c in chat.choices[0].logprobs.content] == [server.engine.tokenizer.decode([42])] * 3
    ref = server.scored["text"].outputs[0]  # greedy: its first token is rank 1
    first = ref.token_ids[0]
    banned = server.http.post(
        "/v1/completions",
        json={"prompt": TEXT, "max_tokens": 1, "temperature": 0, "logprobs": 0, "logit_bias": {str(first): -100}},
    )
    assert banned.json()["choices"][0]["logprobs"]["token_logprobs"][0] < ref.logprobs[0][first].logprob
    for bias, message in [
        ({str(i): 1 for i in range(301)}, "at most 300"),
        ({"512": 1}, "outside the vocabulary"),
        ({"5": 101}, "[-100, 100]"),
        ({"x": 1}, "token ids"),
    ]:
        response = server.http.post("/v1/completions", json={"prompt": TEXT, "logit_bias": bias})
        assert response.status_code == 400 and message in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "logit_bias"
    suffix = server.http.post("/v1/completions", json={"prompt": TEXT, "suffix": "b"})
    assert suffix.status_code == 400 and suffix.json()["error"]["param"] == "suffix"
