"""The engine core in a child process (`jaxpaged serve`'s default) against the engine on a thread:
the same requests give the same text, tokens, logprobs and finish reasons (greedy and seeded
sampling, n > 1, logprobs, stop strings, one ending inside a fused window, exact max_tokens,
streamed deltas); aborts free the child's blocks; a bad request fails alone; the development-mode
routes (sleep, pause, ...) reach the child; start-up errors are the same exceptions; the child's death fails requests at once. One child serves every test (it
imports JAX and compiles); the test that kills it runs last.
"""

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest

from jaxpaged.engine.core_process import EngineCoreProcess
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs, EngineArgsError
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
from jaxpaged.lora_request import LoRARequest
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from jaxpaged.server.app import build_app
from jaxpaged.server.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from jaxpaged.server.dev_routes import DEV_MODE_ENV

# Fused windows of 4 decode steps: a stop string can end inside one (its later tokens dropped).
ARGS = EngineArgs(
    model=DEMO_MODEL_DIR,
    dtype="float32",
    max_model_len=128,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    num_scheduler_steps=4,
    enable_lora=True,  # unused by most tests: requests without an adapter pay nothing
    max_loras=1,
    max_lora_rank=4,
)
PROMPT = "And God said, Let there be light"


@pytest.fixture(scope="module")
def engines():
    """(on a thread, in a child process), both ready."""
    process = AsyncEngine(EngineCoreProcess(ARGS))  # starts in the child while the other compiles
    threaded = AsyncEngine(LLMEngine(ARGS))
    assert process.ready.wait(300), process.dead
    yield threaded, process
    threaded.shutdown()
    process.shutdown()


def collect(engine: AsyncEngine, prompt, params: SamplingParams, request_id: str, lora=None) -> dict:
    """Every delta of one request, and what they add up to per completion."""

    async def run():
        deltas = []
        async for output in engine.generate(prompt, params, request_id, lora_request=lora):
            deltas.append(
                [(c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason) for c in output.outputs]
            )
        return deltas

    deltas = asyncio.run(run())
    total = {}
    for step in deltas:
        for index, text, tokens, logprobs, finish, stop in step:
            c = total.setdefault(index, {"text": "", "tokens": [], "logprobs": []})
            c["text"] += text
            c["tokens"] += tokens
            c["logprobs"] += logprobs or []
            c["finish"], c["stop"] = finish, stop
    return {"deltas": deltas, "total": total}


def test_outputs_are_the_same_with_the_engine_in_a_process(engines):
    threaded, process = engines
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    reference = collect(threaded, PROMPT, greedy, "ref")["total"][0]
    words = reference["text"].split()
    assert len(words) > 4, reference
    cases = {
        "greedy": greedy,
        "seeded, n=3": SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=3, max_tokens=16),
        "logprobs": SamplingParams(temperature=0.7, seed=3, max_tokens=8, logprobs=3),
        "stop string": SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[words[-3]]),
        # not streamed: decode steps fuse, and the stop string late in the text ends inside a
        # fused window of 4 tokens
        "stop string, one output": SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop=[words[-3]], output_kind=RequestOutputKind.FINAL_ONLY
        ),
        "stop kept": SamplingParams(temperature=0, max_tokens=24, stop=[words[2]], include_stop_str_in_output=True),
        "max_tokens": SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    }
    dropped = []  # tokens of a fused window after a stop string, dropped by the engine on a thread
    stop_on_string = threaded.engine.scheduler.stop_on_string
    threaded.engine.scheduler.stop_on_string = lambda seq, n, stop: (
        dropped.append(len(seq.output_token_ids) - n),
        stop_on_string(seq, n, stop),
    )
    for name, params in cases.items():
        dropped.clear()
        a = collect(threaded, PROMPT, params, f"t-{name}")
        b = collect(process, PROMPT, params, f"p-{name}")
        assert a == b, name
        if name == "stop string, one output":
            assert (
                len(a["deltas"]) == 1 and a["total"] == collect(threaded, PROMPT, cases["stop string"], "t-s")["total"]
            )
            assert dropped and dropped[0] > 0, "the stop string should end inside a fused window"
    stopped = collect(process, PROMPT, cases["stop string"], "p-stop-again")["total"][0]
    assert stopped["finish"] == "stop" and stopped["stop"] == words[-3] and words[-3] not in stopped["text"]
    assert len(stopped["tokens"]) < 24
    assert len(collect(process, PROMPT, cases["max_tokens"], "p-max")["total"][0]["tokens"]) == 7


def test_a_lora_adapter_crosses_the_process(engines, tmp_path):
    """A request naming a LoRA adapter (a PEFT adapter of the demo model) gets the same tokens
    from the engine in its own process as from the one on a thread, and not the base model's."""
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    peft.get_peft_model(base, config).save_pretrained(str(tmp_path))
    lora = LoRARequest("demo-lora", 1, str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    threaded, process = engines
    with_lora = [collect(e, PROMPT, params, f"lora-{i}", lora)["total"] for i, e in enumerate(engines)]
    assert with_lora[0] == with_lora[1]
    assert with_lora[0][0]["tokens"] != collect(threaded, PROMPT, params, "no-lora")["total"][0]["tokens"]


def test_concurrent_requests_match(engines):
    """Steps differ in who shares them (timing), not in any request's tokens."""
    threaded, process = engines
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=12, n=2)

    async def run(engine: AsyncEngine, tag: str):
        async def one(i):
            return [o async for o in engine.generate(f"{PROMPT} {i}", params, f"{tag}{i}")]

        outs = await asyncio.gather(*(one(i) for i in range(12)))
        return [
            [sum((c.token_ids for o in out for c in o.outputs if c.index == k), []) for k in (0, 1)] for out in outs
        ]

    assert asyncio.run(run(threaded, "t")) == asyncio.run(run(process, "p"))


def test_prompt_logprobs_and_logit_bias_cross_the_process(engines):
    """Prompt logprobs travel in the deltas (numpy arrays, pickled) and come out the same."""
    threaded, process = engines
    params = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2, logit_bias={100: 100.0})

    async def run(engine: AsyncEngine, request_id: str):  # (streamed: deltas, prompt logprobs once)
        outputs = [o async for o in engine.generate(PROMPT, params, request_id)]
        [prompt_logprobs] = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
        return prompt_logprobs, [t for o in outputs for t in o.outputs[0].token_ids], outputs[0].prompt_token_ids

    (a, a_tokens, prompt), (b, b_tokens, _) = asyncio.run(run(threaded, "t-plp")), asyncio.run(run(process, "p-plp"))
    assert a == b and len(a) == len(prompt) and a[0] is None
    assert a_tokens == b_tokens == [100] * 4


def test_structured_outputs_in_the_child_match_and_a_bad_grammar_fails_alone(engines):
    """Matchers live in the child: the same constrained outputs as on a thread (greedy, seeded
    n=2); an invalid grammar fails its request with an error naming the field (the client's fault),
    from the child."""
    threaded, process = engines
    cases = {
        "regex": SamplingParams(
            temperature=0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,6}-[0-9]{2}")
        ),
        "choice, n=2": SamplingParams(
            temperature=1.0, seed=5, n=2, structured_outputs=StructuredOutputsParams(choice=["light", "dark"])
        ),
    }
    for name, params in cases.items():
        a = collect(threaded, PROMPT, params, f"t-so-{name}")
        assert a == collect(process, PROMPT, params, f"p-so-{name}"), name
        assert all(c["finish"] == "stop" for c in a["total"].values()), a
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a[b"))
    with pytest.raises(RequestFailedError, match=r"^structured_outputs\.regex:") as err:
        collect(process, PROMPT, bad, "p-so-bad")
    assert err.value.error_type == "invalid_request_error"


def test_abort_frees_the_child_s_blocks_and_a_bad_request_fails_alone(engines):
    _, process = engines

    async def run():
        stream = await process.add_requests(["long"], [PROMPT], SamplingParams(max_tokens=100, ignore_eos=True))
        first = await stream.__anext__()
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await process.add_requests(["bad"], [{"prompt_token_ids": [10**9]}], SamplingParams())
        stream.abort()
        for _ in range(200):
            stats = process.stats
            if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]:
                return first
            await asyncio.sleep(0.05)
        raise AssertionError(f"blocks not returned: {process.stats}")

    assert asyncio.run(run()).outputs[0].token_ids
    assert process.num_unfinished_seqs == 0 and process.is_ready


def test_dev_mode_routes_drive_the_child_between_steps(engines, monkeypatch):
    """The development-mode routes reach the engine in its process: a paused engine keeps a
    request waiting, sleep is refused (409) while it waits and a bad mode or level (or level 2,
    whose weights no route gives back) is a 400, the
    engine going on after each; after resume, sleep (level 1), a prefix-cache reset and wake_up,
    the same greedy completion comes back."""
    _, process = engines
    monkeypatch.setenv(DEV_MODE_ENV, "1")
    app = build_app(process, "m")
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            assert (await http.post("/pause?mode=keep")).status_code == 200
            waiting = asyncio.create_task(http.post("/v1/completions", json=body))
            while process.num_unfinished_seqs == 0:  # added (the child gets it before the next call)
                await asyncio.sleep(0.01)
            refused = [await http.post(url) for url in ("/sleep?level=1", "/pause?mode=later")]
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
            assert (await http.post("/resume")).status_code == 200
            first = await waiting
            calls = [
                await http.post("/sleep?level=1"),
                await http.post("/sleep?level=5"),
                await http.post("/sleep?level=2"),  # no route could give the weights back
                await http.get("/is_sleeping"),
                await http.post("/reset_prefix_cache"),
                await http.post("/wake_up"),
                await http.get("/is_sleeping"),
            ]
            return refused, first, calls, await http.post("/v1/completions", json=body)

    refused, first, calls, again = asyncio.run(run())
    assert [r.status_code for r in refused] == [409, 400], [r.text for r in refused]
    assert "unfinished" in refused[0].json()["error"]["message"]
    assert "mode='later'" in refused[1].json()["error"]["message"]
    assert [r.status_code for r in calls] == [200, 400, 400, 200, 200, 200, 200]
    assert "level=5" in calls[1].json()["error"]["message"]
    assert calls[2].json()["error"]["param"] == "level" and "level=2" in calls[2].json()["error"]["message"]
    assert calls[3].json() == {"is_sleeping": True} and calls[6].json() == {"is_sleeping": False}
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    text = first.json()["choices"][0]["text"]
    assert text and again.json()["choices"][0]["text"] == text
    assert process.is_ready and process.num_unfinished_seqs == 0


def test_profile_routes_trace_the_engines_process(engines, tmp_path):
    """With a profiler directory the app has /start_profile and /stop_profile (without, 404): the
    trace is of the child, written where the route says, with the steps it ran; starting twice
    or stopping none is a 409; the engine serves on."""
    _, process = engines
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}

    async def run(app, requests):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return [await (http.post(url, json=body) if url.startswith("/v1") else http.post(url)) for url in requests]

    [absent] = asyncio.run(run(build_app(process, "m"), ["/start_profile"]))
    assert absent.status_code == 404
    app = build_app(process, "m", profiler_dir=str(tmp_path / "traces"))
    calls = asyncio.run(
        run(app, ["/stop_profile", "/start_profile", "/start_profile", "/v1/completions", "/stop_profile"])
    )
    assert [r.status_code for r in calls] == [409, 200, 409, 200, 200], [r.text for r in calls]
    assert "no profile is running" in calls[0].json()["error"]["message"]
    assert "already being written" in calls[2].json()["error"]["message"]
    run_dir = Path(calls[4].json()["profile_dir"])
    assert run_dir.parent == tmp_path / "traces" / "plugins" / "profile"
    [trace] = run_dir.glob("*.xplane.pb")
    assert trace.stat().st_size > 10_000  # the child's steps, not an empty trace
    assert process.is_ready and process.num_unfinished_seqs == 0


def test_start_up_errors_are_the_same_exceptions(tmp_path):
    args = EngineArgs(model=str(tmp_path / "missing"))
    with pytest.raises(EngineArgsError) as in_process:
        LLMEngine(args)
    core = EngineCoreProcess(args)
    with pytest.raises(EngineArgsError) as in_child:
        core.wait_ready()
    core.stop(timeout=30.0)
    assert str(in_child.value) == str(in_process.value) and in_child.value.field == "model"


def test_the_child_s_death_fails_requests_at_once(engines):
    _, process = engines
    deaths = []
    process._on_dead = deaths.append

    async def run():
        stream = await process.add_requests(["doomed"], [PROMPT], SamplingParams(max_tokens=100, ignore_eos=True))
        await stream.__anext__()
        os.kill(process._core.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine process died"):
            async with asyncio.timeout(30):
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError):
            await process.add_requests(["after"], [PROMPT], SamplingParams())

    asyncio.run(run())
    assert not process.is_ready and deaths  # `on_dead` runs before the streams learn of the death
