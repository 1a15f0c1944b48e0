"""The load and evaluation tools vLLM's users run, against `jaxpaged serve` (issue 45), each from
its current release: guidellm 0.8.1 (the tool vLLM's docs point to) completes its runs with no
errors, on chat, completions and responses, streamed as it streams (`stream_options` with vLLM's
`continuous_usage_stats`), behind an API key; lm-eval 0.4.13's `local-completions` (log-likelihoods
from echoed prompt logprobs, and generations) and `local-chat-completions` run a task of their own
(four KJV continuations, the demo model's text) to the scores the engine's own answers give;
vLLM's router (vllm-router 0.1.17) in front of two servers answers every request.

Both need torch, which the server-only venv this file runs in (CI stage 3) must not have: they
are installed in a venv of their own and run as subprocesses, found through `$JAXPAGED_TOOLS_BIN`:

    python3 -m venv .venv-tools
    .venv-tools/bin/pip install torch==2.13.0 guidellm==0.8.1 'lm-eval[api]==0.4.13' vllm-router==0.1.17
    JAXPAGED_TOOLS_BIN=.venv-tools/bin pytest tests/test_vllm_tools.py
"""

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

TOOLS_BIN = os.environ.get("JAXPAGED_TOOLS_BIN")
GUIDELLM, LM_EVAL, ROUTER = (os.path.join(TOOLS_BIN or "", name) for name in ("guidellm", "lm_eval", "vllm-router"))
if not (TOOLS_BIN and all(os.access(tool, os.X_OK) for tool in (GUIDELLM, LM_EVAL, ROUTER))):  # skipped, with why
    pytest.skip(
        "needs guidellm, lm-eval and vllm-router in a venv of their own (torch): see this file's docstring",
        allow_module_level=True,
    )

from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR  # noqa: E402 (after the skip)

KEY = "sk-tools"
OFFLINE = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "NO_PROXY": "127.0.0.1",
    "no_proxy": "127.0.0.1",
}


@pytest.fixture(scope="module")
def served(demo_server):
    served = demo_server.serve("demo", api_key=KEY)
    yield served
    served.close()


def guidellm(url: str, out: str, request_format: str, profile: str, requests: int) -> dict:
    """One guidellm run of `requests` synthetic requests (32 prompt tokens, 8 out, the demo model's
    tokenizer); its JSON report's first benchmark."""
    argv = [
        GUIDELLM,
        "run",
        f"--backend=kind=openai_http,target={url},request_format={request_format},api_key={KEY}",
        f"--profile=kind={profile}",
        f"--constraint=kind=max_requests,count={requests}",
        "--data=kind=synthetic_text,prompt_tokens=32,output_tokens=8",
        f"--tokenizer=kind=hf_auto,model={DEMO_MODEL_DIR}",
        f"--output=kind=json,path={out}",
        "--disable-console",
    ]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=OFFLINE)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    with open(out) as f:
        return json.load(f)["benchmarks"][0]


@pytest.mark.parametrize(
    ("request_format", "profile"),
    [
        ("/v1/chat/completions", "concurrent,streams=4"),
        ("/v1/completions", "synchronous"),
        ("/v1/responses", "concurrent,streams=2"),
    ],
)
def test_guidellm_completes_its_run_with_no_errors(served, tmp_path, request_format, profile):
    report = guidellm(served.url, str(tmp_path / "report.json"), request_format, profile, requests=8)
    # The requests' own records (the scheduler's running counts, `scheduler_metrics.requests_made`,
    # are a snapshot taken as each result arrives: under load the last one can be missing from them).
    assert report["metrics"]["request_totals"] == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}
    output_tokens = report["metrics"]["output_token_count"]["successful"]  # counted from our usage
    assert output_tokens["total_sum"] == 8 * 8, output_tokens


# Four continuations the demo model (trained on the KJV) knows, as a multiple-choice task and a
# generation task of lm-eval's YAML format over a local JSON file.
DOCS = [
    ("In the beginning God created the heaven and the", ["earth", "sea", "stars"]),
    ("And God said, Let there be", ["light", "night", "water"]),
    ("And the evening and the morning were the first", ["day", "year", "hour"]),
    ("Adam knew Eve his", ["wife", "sister", "mother"]),
]
TASKS = {
    "choice.yaml": """task: jaxpaged_choice
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list: [{{metric: acc, aggregation: mean, higher_is_better: true}}]
""",
    "gen.yaml": """task: jaxpaged_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[0]}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: 8, do_sample: false}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
""",
}


def lm_eval(tmp_path: Path, model: str, model_args: str, tasks: str, *extra: str) -> tuple[dict, dict]:
    """One lm-eval run of this file's tasks: its results, and each task's responses by prompt."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c}) + "\n" for q, c in DOCS))
    for name, text in TASKS.items():
        (tmp_path / name).write_text(text.format(data=data))
    out = tmp_path / "out"
    argv = [LM_EVAL, "run", "--model", model, "--model_args", model_args, "--tasks", *tasks.split(), *extra]
    argv += ["--include_path", str(tmp_path), "--output_path", str(out), "--log_samples"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**OFFLINE, "OPENAI_API_KEY": KEY})
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    [results] = out.rglob("results_*.json")
    responses = {}
    for samples in out.rglob("samples_*.jsonl"):
        task = samples.name.removeprefix("samples_").rsplit("_", 1)[0]
        lines = [json.loads(line) for line in samples.read_text().splitlines()]
        responses[task] = {s["doc"]["question"]: s["resps"] for s in lines}
    return json.loads(results.read_text())["results"], responses


def greedy(served, prompt: str, chat: bool = False) -> str:
    """The server's greedy completion (8 tokens, to a newline) of `prompt`: as a chat message, or
    as lm-eval sends a completion's prompt, its token ids without special tokens."""
    import httpx

    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "demo", "max_tokens": 8, "temperature": 0, "stop": ["\n"]}
    with httpx.Client(base_url=served.url, trust_env=False, timeout=120, headers=headers) as http:
        if chat:
            message = http.post(
                "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": prompt}]}
            )
            return message.json()["choices"][0]["message"]["content"]
        ids = http.post("/tokenize", json={"model": "demo", "prompt": prompt, "add_special_tokens": False}).json()
        return http.post("/v1/completions", json={**body, "prompt": ids["tokens"]}).json()["choices"][0]["text"]


def test_lm_eval_local_completions_scores_log_likelihoods_and_generations(served, tmp_path):
    """Every right continuation is the likeliest of its choices (acc 1: log-likelihoods read from
    `echo` with `logprobs`, aligned token for token), and each generation is the server's own
    greedy completion of the prompt."""
    args = f"model=demo,base_url={served.url}/v1/completions,tokenizer={DEMO_MODEL_DIR},tokenizer_backend=huggingface"
    results, responses = lm_eval(
        tmp_path, "local-completions", args + ",num_concurrent=2,max_retries=1", "jaxpaged_choice jaxpaged_gen"
    )
    assert results["jaxpaged_choice"]["acc,none"] == 1.0
    for question, _ in DOCS:
        assert responses["jaxpaged_gen"][question] == [[greedy(served, question)]]


def test_lm_eval_local_chat_completions_generates_through_the_chat_template(served, tmp_path):
    args = f"model=demo,base_url={served.url}/v1/chat/completions,num_concurrent=2,max_retries=1"
    _, responses = lm_eval(tmp_path, "local-chat-completions", args, "jaxpaged_gen", "--apply_chat_template")
    for question, _ in DOCS:
        assert responses["jaxpaged_gen"][question] == [[greedy(served, question, chat=True)]]


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two", "cache_aware"])
def test_vllm_router_in_front_of_two_servers_answers_every_request(demo_server, policy):
    """vLLM's router (vllm-router 0.1.17, run as its users run it) over two servers of the demo
    model, for each policy that needs nothing from the workers: chat, completions and a streamed
    chat come back 200 with the servers' own greedy text (the router re-serialises each body with
    its own fields: docs/server.md's request-fields rule)."""
    import httpx

    servers = [demo_server.serve("demo") for _ in range(2)]
    try:
        with _router(policy, [s.url for s in servers]) as http:
            chat = {
                "model": "demo",
                "messages": [{"role": "user", "content": "And God said"}],
                "max_tokens": 8,
                "temperature": 0,
            }
            completion = {"model": "demo", "prompt": "In the beginning", "max_tokens": 8, "temperature": 0}
            direct = httpx.Client(base_url=servers[0].url, trust_env=False, timeout=60)
            want_chat = direct.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
            want_text = direct.post("/v1/completions", json=completion).json()["choices"][0]["text"]
            for _ in range(4):  # every worker gets some under each policy
                reply = http.post("/v1/chat/completions", json=chat)
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["message"]["content"] == want_chat
                reply = http.post("/v1/completions", json=completion)
                assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == want_text, reply.text
            with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as stream:
                assert stream.status_code == 200
                events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
            chunks = [json.loads(e) for e in events[:-1]]
            pieces = [c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]]
            assert events[-1] == "[DONE]" and "".join(pieces) == want_chat
            refused = http.post("/v1/completions", json={**completion, "return_hidden_states": True})
            assert refused.status_code == 400 and "return_hidden_states" in refused.text
    finally:
        for served in servers:
            served.close()


# Run by the tools' Python: the router manifest's container args, parsed by vllm-router's own
# parser (`$(VAR)` replaced as the kubelet does), and what they set.
_PARSE_ROUTER_MANIFEST = r"""
import json, re, sys, yaml
from vllm_router.launch_router import parse_router_args
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "Deployment"]
argv = [re.sub(r"\$\((\w+)\)", "from-env", a) for a in docs[0]["spec"]["template"]["spec"]["containers"][0]["args"]]
a = parse_router_args(argv)
print(json.dumps({k: getattr(a, k) for k in ("host", "port", "policy", "service_discovery", "selector",
    "service_discovery_port", "service_discovery_namespace", "api_key")}))
"""


def test_the_router_manifest_s_flags_parse_with_the_router_s_own_parser():
    """deploy/kubernetes/router/router.yaml's args mean to vllm-router what tests/test_deploy.py
    checks they say: its Kubernetes mode over the jaxpaged pods' label and port."""
    manifest = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "router" / "router.yaml"
    run = subprocess.run(
        [os.path.join(TOOLS_BIN, "python"), "-c", _PARSE_ROUTER_MANIFEST, str(manifest)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout) == {
        "host": "0.0.0.0",
        "port": 8000,
        "policy": "cache_aware",
        "service_discovery": True,
        "selector": {"app.kubernetes.io/name": "jaxpaged"},
        "service_discovery_port": 8000,
        "service_discovery_namespace": "from-env",
        "api_key": "from-env",
    }


@contextlib.contextmanager
def _router(policy: str, worker_urls: list[str], extra: tuple[str, ...] = ()):
    """vllm-router with `policy` over `worker_urls` on a free loopback port, once it answers: a
    client of it; the router is stopped on exit."""
    import time

    import httpx

    argv = [ROUTER, "--host", "127.0.0.1", "--port", str(port := _free_port()), "--policy", policy, *extra]
    router = subprocess.Popen([*argv, "--worker-urls", *worker_urls], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False, timeout=60)
        deadline = time.time() + 60
        while time.time() < deadline and router.poll() is None:
            try:
                if http.get("/v1/models").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert router.poll() is None, router.communicate()[0].decode(errors="replace")[-2000:]
        yield http
    finally:
        router.terminate()
        router.wait(timeout=30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Two tasks, each a shared instruction prefix of a few KV blocks, and the notes sent with them
# (the clinical workload's shape at the demo model's size), in an order that round robin splits.
PREFIX_TASKS = {
    "genesis": "Summarise the passage in one line. In the beginning God created the heaven and the earth. "
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "exodus": "Name the people in the passage. Now these are the names of the children of Israel, which "
    "came into Egypt; every man and his household came with Jacob. Reuben, Simeon, Levi, and Judah.",
}
NOTES = (" And God said", " Let there be light", " And there was light", " And God saw")


def test_vllm_router_kv_aware_sends_each_prefix_to_the_replica_holding_it():
    """Two engines with KV events on (`kv_events_config`), vllm-router 0.1.17's `kv_aware` policy
    following them (`--kv-event-source`; it asks the workers' /v1/completions/render for the
    token ids). Each task's prefix is first computed on a replica of its own (sent to it directly,
    genesis to the second, exodus to the first, as no load-only choice would place them); then
    every request of a task runs on the replica holding its prefix and reuses it, while round robin
    splits the tasks and reuses less."""

    import httpx
    from demo_server import DemoServer
    from shared_engines import CANONICAL

    from jaxpaged import LLM

    replicas, served, event_ports = [], [], []
    try:
        for _ in range(2):
            event_ports.append(_free_port())
            events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{event_ports[-1]}"}
            replicas.append(DemoServer(LLM(**CANONICAL["demo-server"], kv_events_config=events)))
            served.append(replicas[-1].serve("demo"))
        block_size = replicas[0].llm.llm_engine.config.cache.block_size
        sources = [f"{s.url}=tcp://127.0.0.1:{p}" for s, p in zip(served, event_ports)]
        kv_aware = ["--kv-event-model", "demo", "--kv-event-block-size", str(block_size), "--router-temperature", "0"]
        for source in sources:
            kv_aware += ["--kv-event-source", source]
        managers = [r.llm.llm_engine.scheduler.block_manager for r in replicas]

        def compute_prefix(task: str, home: int):
            body = {"model": "demo", "prompt": PREFIX_TASKS[task], "max_tokens": 1}
            return httpx.post(f"{served[home].url}/v1/completions", json=body)

        def counters() -> list[tuple[int, int]]:
            return [(m.prefix_cache_queries, m.prefix_cache_hits) for m in managers]

        placements = {}
        for policy, extra in (("kv_aware", kv_aware), ("round_robin", [])):
            for replica in replicas:
                replica.llm.llm_engine.reset_prefix_cache()
            placements[policy] = _place_tasks(policy, extra, [s.url for s in served], compute_prefix, counters)
        kv, rr = placements["kv_aware"], placements["round_robin"]
        for task, home in zip(PREFIX_TASKS, (1, 0)):
            assert {replica for replica, _ in kv[task]} == {home}, kv
            assert min(hits for _, hits in kv[task]) >= 2 * block_size, kv  # every one reused the prefix
        kv_hits, rr_hits = (sum(hits for runs in p.values() for _, hits in runs) for p in (kv, rr))
        assert rr_hits < kv_hits, (kv, rr)
        assert any(len({replica for replica, _ in rr[task]}) == 2 for task in PREFIX_TASKS), rr
    finally:
        for s in served:
            s.close()
        for replica in replicas:
            replica.close()
            replica.llm.llm_engine.shutdown()


def _place_tasks(policy: str, extra: list[str], worker_urls: list[str], compute_prefix, counters) -> dict:
    """Computes each task's prefix on its replica (`compute_prefix(task, home)`: genesis on the
    second, exodus on the first), then sends the tasks' notes through a router of `policy` over
    `worker_urls`, one at a time (A A B B A A B B); for each, the replica that ran it and the
    prompt tokens its prefix cache served (`counters()`: each replica's prefix-cache queries and
    hits)."""
    import time

    placed = {task: [] for task in PREFIX_TASKS}
    with _router(policy, worker_urls, tuple(extra)) as http:
        time.sleep(0.5)  # its subscriptions join the publishers (events sent before are lost to it)
        for task, home in zip(PREFIX_TASKS, (1, 0)):
            direct = compute_prefix(task, home)
            assert direct.status_code == 200, direct.text
        time.sleep(0.3)
        order = [task for task in PREFIX_TASKS for _ in range(2)] * 2  # genesis genesis exodus exodus ...
        for i, task in enumerate(order):
            before = counters()
            body = {
                "model": "demo",
                "prompt": PREFIX_TASKS[task] + NOTES[i % len(NOTES)],
                "max_tokens": 2,
                "temperature": 0,
            }
            reply = http.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            after = counters()
            ran = [j for j, (b, a) in enumerate(zip(before, after)) if a[0] != b[0]]
            assert len(ran) == 1, ran
            placed[task].append((ran[0], after[ran[0]][1] - before[ran[0]][1]))
            time.sleep(0.3)  # the step's events reach the router
    return placed


def test_vllm_router_kv_aware_follows_the_replicas_of_a_data_parallel_server():
    """One server of two replicas (`--data-parallel-size 2`: each publishes its KV events on the
    endpoint's port + its rank), the router told so (`--intra-node-data-parallel-size 2`, both
    endpoints in one `--kv-event-source`): it sends each task to the replica holding its prefix
    with vLLM's `X-data-parallel-rank` header, which the server honours."""
    import httpx
    from demo_server import Served
    from shared_engines import CANONICAL

    from jaxpaged.engine.core_process import EngineCoreProcess
    from jaxpaged.engine_args import EngineArgs
    from jaxpaged.engine_config import EngineConfig
    from jaxpaged.server.data_parallel import DataParallelEngine, core_replicas

    port = _free_port()
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
    args = EngineArgs(**CANONICAL["demo-server"], kv_events_config=events, data_parallel_size=2)
    config = EngineConfig.resolve(args)
    replicas = DataParallelEngine(
        core_replicas(config, [EngineCoreProcess(config.for_replica(r)) for r in range(2)]), 2
    )
    served = None
    try:
        assert replicas.ready.wait(300), [r.dead for r in replicas.replicas]
        served = Served(replicas, "demo", {"log_level": "warning"}, {})
        endpoints = f"{served.url}=tcp://127.0.0.1:{port},tcp://127.0.0.1:{port + 1}"
        extra = ["--intra-node-data-parallel-size", "2", "--kv-event-source", endpoints, "--kv-event-model", "demo"]
        extra += ["--kv-event-block-size", str(config.cache.block_size), "--router-temperature", "0"]

        def compute_prefix(task: str, home: int):
            body = {"model": "demo", "prompt": PREFIX_TASKS[task], "max_tokens": 1}
            return httpx.post(f"{served.url}/v1/completions", json=body, headers={"X-data-parallel-rank": str(home)})

        def counters() -> list[tuple[int, int]]:
            return [(r.stats["prefix_cache_queries"], r.stats["prefix_cache_hits"]) for r in replicas.replicas]

        placed = _place_tasks("kv_aware", extra, [served.url], compute_prefix, counters)
        for task, home in zip(PREFIX_TASKS, (1, 0)):
            assert {replica for replica, _ in placed[task]} == {home}, placed
            assert min(hits for _, hits in placed[task]) >= 2 * config.cache.block_size, placed
    finally:
        if served is not None:
            served.close()
        replicas.shutdown()


def test_a_replica_killed_under_load_loses_no_unstarted_request_and_rejoins(tmp_path):
    """deploy/router_replicas.sh: two demo replicas behind the router (round robin: the restarted
    replica gets every other request once the router takes it back). 24 streamed
    requests, 6 at a time; after 4 have finished, replica 1's server is killed (SIGKILL). Every
    request is answered whole except those that had already streamed tokens from it ("cut": nothing
    can recover those); none fails before its first token (a streamed response starts with its
    first output, so the router retries those elsewhere). The script starts the replica again and
    the router sends it requests once it is healthy. A replica then drained (SIGTERM) under load
    finishes its requests, and those sent meanwhile are all answered. SIGTERM to the script stops
    everything."""
    import concurrent.futures
    import re
    import signal
    import sys
    import threading
    import time

    import httpx

    from benchmarks.router_failover import served_requests, stream_one

    port, first_port, events_port = _free_port(), _free_port(), _free_port()
    while abs(first_port - port) < 2 or abs(events_port - port) < 2 or abs(events_port - first_port) < 2:
        first_port, events_port = _free_port(), _free_port()
    env = {
        **os.environ,
        "PORT": str(port),
        "FIRST_PORT": str(first_port),
        "EVENTS_PORT": str(events_port),
        "ROUTER": ROUTER,
        "JAXPAGED": os.path.join(os.path.dirname(sys.executable), "jaxpaged"),
        "SERVED_MODEL_NAME": "demo",
        "POLICY": "round_robin",
        "NO_PROXY": "127.0.0.1",
    }
    script = Path(__file__).resolve().parent.parent / "deploy" / "router_replicas.sh"
    log = tmp_path / "replicas.log"
    flags = ["--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
    with open(log, "w") as out:
        process = subprocess.Popen([str(script), "demo", "2", *flags], env=env, stdout=out, stderr=subprocess.STDOUT)
    url, replica_1 = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{first_port + 1}"

    def pids() -> list[int]:
        return [int(p) for p in re.findall(r"^replica 1 pid (\d+)", log.read_text(), re.MULTILINE)]

    try:
        deadline = time.time() + 600
        while time.time() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        assert process.poll() is None, log.read_text()[-3000:]
        finished, killed = [], threading.Event()

        def one(i: int) -> str:
            outcome = stream_one(url, i, 40)
            finished.append(outcome)
            if len(finished) >= 4 and not killed.is_set():
                killed.set()
                os.kill(pids()[-1], signal.SIGKILL)
            return outcome

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            outcomes = list(pool.map(one, range(24)))
        assert killed.is_set() and outcomes.count("lost") == 0, outcomes
        assert outcomes.count("ok") >= 24 - 6, outcomes  # at most what was running on it is cut
        deadline = time.time() + 240
        while time.time() < deadline and len(pids()) < 2:
            time.sleep(0.5)
        assert len(pids()) == 2, log.read_text()[-3000:]  # started again
        rejoined = 0.0
        while time.time() < deadline and not rejoined:
            try:
                rejoined = served_requests(replica_1)
            except httpx.TransportError:
                pass  # still starting
            if not rejoined:
                assert stream_one(url, 100, 2) == "ok"  # the router never sends it to a replica still down
                time.sleep(0.5)
        assert rejoined, log.read_text()[-3000:]
        # a draining replica (SIGTERM) finishes what it runs and takes nothing new that fails
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            running = [pool.submit(stream_one, url, 200 + i, 120) for i in range(8)]
            time.sleep(1.0)
            os.kill(pids()[-1], signal.SIGTERM)
            time.sleep(0.3)
            sent_while_draining = [pool.submit(stream_one, url, 300 + i, 8) for i in range(12)]
            outcomes = [f.result() for f in running + sent_while_draining]
        assert outcomes == ["ok"] * 20, outcomes
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=90) == 0, log.read_text()[-3000:]
