"""`--data-parallel-size`: two replicas of the demo engine, each in its engine process, behind one
`DataParallelEngine`, against one engine on a thread. Seeded and greedy requests give the same
tokens and logprobs; concurrent requests are spread over both replicas and the stats add up;
controls reach every replica; a replica killed with SIGKILL under load fails only the requests
that had streamed from it, the others finish on the other replica with the tokens they would have
had, and the replica comes back and takes requests again. The kill runs last.
"""

import asyncio
import dataclasses
import os
import signal
import threading
import time

import httpx
import pytest

from jaxpaged.config.checks import OptionError
from jaxpaged.engine.core_process import EngineCoreProcess
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.engine_config import EngineConfig
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
from jaxpaged.parallel.replicas import replica_gpus
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.server.app import build_app
from jaxpaged.server.async_engine import AsyncEngine, EngineDeadError
from jaxpaged.server.data_parallel import DataParallelEngine, combine_stats, core_replicas

# Two running sequences per replica: under load some wait, so a replica's death finds requests
# that have not streamed anything yet.
ARGS = EngineArgs(model=DEMO_MODEL_DIR, dtype="float32", max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64)
PROMPTS = [f"And {who} said unto" for who in ("God", "Moses", "Aaron", "Pharaoh", "the people", "Joseph")]


@pytest.fixture(scope="module")
def engines():
    """(one engine on a thread, two replicas in processes), all ready."""
    config = EngineConfig.resolve(dataclasses.replace(ARGS, data_parallel_size=2))
    cores = [EngineCoreProcess(config.for_replica(r)) for r in range(2)]  # they start while the other compiles
    deaths = []
    replicas = DataParallelEngine(core_replicas(config, cores), 2, on_dead=deaths.append)
    single = AsyncEngine(LLMEngine(ARGS))
    assert replicas.ready.wait(300), [r.dead for r in replicas.replicas]
    yield single, replicas
    single.shutdown()
    replicas.shutdown()
    assert not deaths


def params(i: int, max_tokens: int = 16) -> SamplingParams:
    """Greedy for even `i`, seeded sampling with logprobs for odd."""
    if i % 2 == 0:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return SamplingParams(temperature=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


async def run_one(engine, i: int, max_tokens: int = 16, started: list | None = None) -> dict:
    """One request's tokens and logprobs, the replica it was added to and the one it finished on
    (where it is a `ReplicaStream`); `started` gets `(i, replica)` at its first output."""
    stream = await engine.add_requests([f"r{i}"], [PROMPTS[i % len(PROMPTS)]], params(i, max_tokens))
    first = getattr(stream, "_replica", None)
    tokens, logprobs = [], []
    async for output in stream:
        if started is not None and not tokens:
            started.append((i, stream._replica))
        tokens += output.outputs[0].token_ids
        logprobs += [{t: lp.logprob for t, lp in step.items()} for step in output.outputs[0].logprobs or []]
    return {"tokens": tokens, "logprobs": logprobs, "added_to": first, "replica": getattr(stream, "_replica", None)}


async def run_all(engine, n: int, max_tokens: int = 16) -> list[dict]:
    return await asyncio.gather(*(run_one(engine, i, max_tokens) for i in range(n)))


def test_replicas_answer_like_one_engine_and_share_the_load(engines):
    single, replicas = engines
    expected = asyncio.run(run_all(single, 8))
    before = [r.stats.get("prompt_tokens", 0) for r in replicas.replicas]
    got = asyncio.run(run_all(replicas, 8))
    assert [g["tokens"] for g in got] == [e["tokens"] for e in expected]
    for g, e in zip(got, expected, strict=True):  # batches of other sizes: float32 sums in another order
        assert [step.keys() for step in g["logprobs"]] == [step.keys() for step in e["logprobs"]]
        for g_step, e_step in zip(g["logprobs"], e["logprobs"], strict=True):
            assert all(abs(g_step[t] - e_step[t]) < 1e-3 for t in e_step), (g_step, e_step)
    on = [replicas.replicas.index(g["replica"]) for g in got]
    assert sorted(set(on)) == [0, 1], on  # 8 at once over 2 x 2 running: both take some
    after = [r.stats["prompt_tokens"] for r in replicas.replicas]
    assert all(a > b for a, b in zip(after, before, strict=True))
    combined = replicas.stats
    assert combined["prompt_tokens"] == sum(after)
    assert combined["num_total_blocks"] == sum(r.stats["num_total_blocks"] for r in replicas.replicas)
    assert replicas.config.parallel.data_parallel_size == 2
    assert [r.config.parallel.data_parallel_rank for r in replicas.replicas] == [0, 1]
    assert replicas.config.load.seed + 1 == replicas.replicas[1].config.load.seed


def test_the_rank_header_pins_a_request_to_its_replica(engines):
    """vLLM's `X-data-parallel-rank` (what a router that follows the replicas' KV events sends)."""
    _, replicas = engines
    app = build_app(replicas, "m")
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}

    async def run(headers: dict) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return await http.post("/v1/completions", json=body, headers=headers)

    for rank in (1, 0, 1):
        before = [r.stats["prompt_tokens"] for r in replicas.replicas]
        assert asyncio.run(run({"X-data-parallel-rank": str(rank)})).status_code == 200
        grew = [r.stats["prompt_tokens"] > b for r, b in zip(replicas.replicas, before, strict=True)]
        assert grew == [rank == 0, rank == 1]
    for value, message in (("2", "X-data-parallel-rank 2: this server runs 2 engine replica"), ("x", "an integer")):
        answer = asyncio.run(run({"x-data-parallel-rank": value}))
        assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text


def test_controls_reach_every_replica(engines):
    _, replicas = engines
    assert replicas.control("pause_generation").result(30) is None
    assert [r.control("is_paused").result(30) for r in replicas.replicas] == [True, True]
    replicas.control("resume_generation").result(30)
    assert replicas.control("is_paused").result(30) is False
    with pytest.raises(ValueError, match="must be one of"):
        replicas.control("not_a_control")


def test_each_replica_sees_its_own_group_of_gpus():
    assert [replica_gpus(r, 2, 2, None) for r in range(2)] == ["0,1", "2,3"]
    assert [replica_gpus(r, 1, 3, "4, 6,7") for r in range(3)] == ["4", "6", "7"]
    with pytest.raises(OptionError, match=r"data_parallel_size=3: 3 replicas of 2 devices need 6 GPUs.* lists 4"):
        replica_gpus(0, 2, 3, "0,1,2,3")


def test_combined_stats_sum_counters_and_recompute_usage():
    stats = combine_stats(
        [
            {"num_free_blocks": 10, "num_total_blocks": 20, "gpu_cache_usage_perc": 0.5, "per_pos": [1, 2]},
            {"num_free_blocks": 20, "num_total_blocks": 20, "gpu_cache_usage_perc": 0.0, "per_pos": [3, 4]},
        ]
    )
    assert stats == {"num_free_blocks": 30, "num_total_blocks": 40, "gpu_cache_usage_perc": 0.25, "per_pos": [4, 6]}
    info = combine_stats(
        [
            {"lora_requests_info": {"max_lora": "2", "running_lora_adapters": "a,b"}},
            {"lora_requests_info": {"max_lora": "2", "running_lora_adapters": "c"}},
        ]
    )["lora_requests_info"]
    assert info == {"max_lora": "2", "running_lora_adapters": "a,b,c"}


def test_a_replica_that_cannot_start_fails_the_server_once():
    """Without JAX: replicas on threads whose engines fail to build, one while the other still starts."""
    go_on = threading.Event()

    def build(rank):
        def factory():
            if rank == 0:
                go_on.wait(30)
            raise RuntimeError(f"replica {rank} cannot start")

        return factory

    deaths = []
    replicas = DataParallelEngine(lambda rank, dead: AsyncEngine(build(rank), on_dead=dead), 2, on_dead=deaths.append)
    for _ in range(300):
        if deaths:
            break
        time.sleep(0.01)
    assert len(deaths) == 1 and replicas.dead is deaths[0] and not replicas.is_ready
    with pytest.raises(EngineDeadError):
        asyncio.run(replicas.add_requests(["x"], ["hi"], SamplingParams()))
    go_on.set()
    replicas.replicas[0]._thread.join(30)
    assert len(deaths) == 1
    replicas.shutdown()


def test_requests_being_added_to_a_replica_that_dies_go_to_another(engines):
    """Replica 1 stopped (SIGSTOP: its adds wait unanswered), then killed: the requests the
    balancer gave it are added on replica 0 and answered as one engine answers them; replica 1
    comes back."""
    single, replicas = engines
    expected = asyncio.run(run_all(single, 4))
    victim = replicas.replicas[1]

    async def run():
        os.kill(victim._core.process.pid, signal.SIGSTOP)
        tasks = [asyncio.create_task(run_one(replicas, i)) for i in range(4)]
        await asyncio.sleep(0.5)
        assert victim.num_unfinished_seqs == 2  # every other one, waiting for its add's answer
        os.kill(victim._core.process.pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)

    got = asyncio.run(run())
    assert [g["tokens"] for g in got] == [e["tokens"] for e in expected]
    assert all(g["replica"] is replicas.replicas[0] for g in got)
    wait_until_back(replicas, victim)


def wait_until_back(replicas: DataParallelEngine, dead) -> None:
    """Until replica 1, once `dead`, serves again."""

    async def wait():
        async with asyncio.timeout(240):
            while dead is replicas.replicas[1] or len(replicas._live()) < 2:
                await asyncio.sleep(0.2)

    asyncio.run(wait())


def test_a_killed_replica_fails_only_what_it_streamed_and_comes_back(engines):
    single, replicas = engines
    n = 12
    expected = asyncio.run(run_all(single, n, max_tokens=40))
    victim = replicas.replicas[1]

    async def run():
        started: list = []
        tasks = [asyncio.create_task(run_one(replicas, i, 40, started)) for i in range(n)]
        async with asyncio.timeout(120):
            while not any(replica is victim for _, replica in started):
                await asyncio.sleep(0.01)
        os.kill(victim._core.process.pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return {i for i, replica in started if replica is victim}, results

    streamed_there, results = asyncio.run(run())
    failed = {i for i, r in enumerate(results) if isinstance(r, BaseException)}
    assert all(isinstance(results[i], EngineDeadError) for i in failed), results
    assert failed and failed <= streamed_there  # only what had streamed from the dead replica
    for i in set(range(n)) - failed:  # the rest finished, as they would have on one engine
        assert results[i]["tokens"] == expected[i]["tokens"], i
    moved = [i for i in set(range(n)) - failed if results[i]["added_to"] is victim]
    assert moved and all(results[i]["replica"] is not victim for i in moved)  # they waited there, then moved

    wait_until_back(replicas, victim)
    again = asyncio.run(run_all(replicas, 8))
    assert [g["tokens"] for g in again] == [e["tokens"] for e in asyncio.run(run_all(single, 8))]
    assert replicas.replicas[1] in [g["replica"] for g in again]  # it takes requests again
