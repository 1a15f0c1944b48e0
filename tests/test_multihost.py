"""One engine over two processes with two CPU devices each (`jax.distributed`, collectives over
gloo): process 0 schedules and broadcasts every step, process 1 runs them on its devices. The
tokens equal transformers' (tensor-parallel size 4, kv heads repeated, preemption and prefix
caching on), and the follower exits when the leader shuts down."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import tp_workload
from engine_fixtures import hf_greedy
from safetensors import safe_open
from tiny_models import save_hf_model

from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR

MAX_TOKENS = 10
PROCESS = r"""
import json, logging, os, sys
logging.basicConfig(level=logging.INFO)
from jaxpaged.engine_args import EngineArgs

rank, port, options, prompts = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
args = EngineArgs(**options, nnodes=int(os.environ.get("NNODES", 2)), node_rank=rank, master_port=port)
if rank:
    from jaxpaged.engine.follower import run_follower

    print(json.dumps({"steps": run_follower(args)}))
else:
    from jaxpaged import LLMEngine, SamplingParams

    engine = LLMEngine(args)
    params = SamplingParams(temperature=0, max_tokens=int(sys.argv[5]), ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.outputs[0].token_ids) for o in engine.step() if o.finished)
    stats = engine.get_stats()
    engine.shutdown()
    print(json.dumps({"tokens": [done[str(i)] for i in range(len(prompts))], "stats": stats}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(options: list[dict], prompts: list[list[int]], devices: int = 2) -> list[tuple[int, str, str]]:
    """Runs PROCESS once per entry of `options` (that process's engine options; rank = index),
    each with `devices` CPU devices; returns each one's (exit code, stdout, stderr)."""
    port = free_port()
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "NNODES": str(len(options)),
        "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={devices}",  # the last count wins
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                PROCESS,
                str(rank),
                str(port),
                json.dumps(options[rank]),
                json.dumps(prompts),
                str(MAX_TOKENS),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in reversed(range(len(options)))
    ]
    done = [proc.communicate(timeout=600) for proc in procs]
    return [(proc.returncode, *out_err) for proc, out_err in zip(procs, done)][::-1]


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_two_processes_give_transformers_tokens(tmp_path):
    hf = save_hf_model("llama_tp", str(tmp_path))
    prompts = tp_workload.prompts(seed=1)
    options = tp_workload.engine_options(str(tmp_path), 4)
    results = {}
    for rank, (code, out, err) in enumerate(run_processes([options, options], prompts)):
        assert code == 0, f"process {rank} failed:\n{err[-4000:]}"
        results[rank] = last_json(out)
    assert results[0]["tokens"] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    stats = results[0]["stats"]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert results[1]["steps"] > 0  # the follower ran the leader's steps, then left when told


def test_two_processes_as_two_pipeline_stages_give_transformers_tokens(tmp_path):
    """A stage per process (the pipeline axis spans the processes, as it would span hosts), one
    device each: 5 layers split 3 + 2, each process reading and holding only its stage's layers."""
    hf = save_hf_model("llama_pp", str(tmp_path))
    prompts = tp_workload.prompts(seed=1)
    options = tp_workload.engine_options(str(tmp_path), 1, pp=2)
    results = {}
    runs = run_processes([options, options], prompts, devices=1)
    for rank, (code, out, err) in enumerate(runs):
        assert code == 0, f"process {rank} failed:\n{err[-4000:]}"
        results[rank] = last_json(out)
    assert results[0]["tokens"] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert results[0]["stats"]["prefix_cache_hits"] > 0 and results[1]["steps"] > 0
    # Each process read its own stage's layers from the checkpoint, and the rest (embedding, LM
    # head, final norm) both did.
    reads = [
        re.findall(r"read [\d.]+ GiB \((\d+) bytes\) of tensors .* \(decoder layers (\S+) of 5\)", err)
        for _, _, err in runs
    ]
    assert [[layers for _, layers in r] for r in reads] == [["0-2"], ["3-4"]]
    with safe_open(os.path.join(tmp_path, "model.safetensors"), framework="np") as f:
        sizes = {name: f.get_tensor(name).nbytes for name in f.keys()}
    shared = sum(n for name, n in sizes.items() if ".layers." not in name)
    assert sum(int(r[0][0]) for r in reads) == sum(sizes.values()) + shared


def test_serve_spans_two_processes_and_the_follower_leaves_with_the_leader(tmp_path):
    """`jaxpaged serve --nnodes 2`: process 0 serves HTTP over four devices, two of them in the
    follower process; the completion equals one process's; SIGTERM stops both, exit code 0."""
    import httpx

    from jaxpaged import LLM, SamplingParams

    port, master = free_port(), free_port()
    flags = [
        "serve",
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
        "--tensor-parallel-size",
        "4",
        "--nnodes",
        "2",
        "--master-port",
        str(master),
    ]
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count=2",
    }

    def start(*extra: str) -> tuple[subprocess.Popen, str]:
        log = tmp_path / f"process{len(extra)}.log"
        script = f"import sys\nfrom jaxpaged.cli import main\nsys.exit(main({flags + list(extra)!r}))"
        proc = subprocess.Popen(
            [sys.executable, "-c", script], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env
        )
        return proc, log

    follower, follower_log = start("--node-rank", "1")
    leader, leader_log = start("--node-rank", "0", "--port", str(port), "--uvicorn-log-level", "warning")
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            assert leader.poll() is None and follower.poll() is None, leader_log.read_text() + follower_log.read_text()
            try:
                if httpx.get(url + "/health", trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline, leader_log.read_text()
            time.sleep(0.5)
        body = {"prompt": "In the beginning", "max_tokens": 16, "temperature": 0}
        served = httpx.post(url + "/v1/completions", json=body, trust_env=False, timeout=120).json()
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(120) == 0, leader_log.read_text()
        assert follower.wait(60) == 0, follower_log.read_text()
    finally:
        leader.kill()
        follower.kill()
    assert "the leader stopped after" in follower_log.read_text()
    one = LLM(DEMO_MODEL_DIR, dtype="float32", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32)
    expected = one.generate("In the beginning", SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert served["choices"][0]["text"] == expected[0].outputs[0].text


def test_bad_multi_process_arguments_are_named():
    import pytest

    from jaxpaged import LLMEngine
    from jaxpaged.engine.follower import run_follower
    from jaxpaged.engine_args import EngineArgs, EngineArgsError

    demo = dict(model=DEMO_MODEL_DIR)
    with pytest.raises(EngineArgsError, match="node_rank=2: must be below nnodes \\(2\\)"):
        EngineArgs(**demo, nnodes=2, node_rank=2)
    with pytest.raises(EngineArgsError, match="master_port=70000: must be a TCP port"):
        EngineArgs(**demo, nnodes=2, master_port=70000)
    with pytest.raises(EngineArgsError, match="node_rank=1: only process 0 runs the engine"):
        LLMEngine(EngineArgs(**demo, nnodes=2, node_rank=1))
    with pytest.raises(EngineArgsError, match="node_rank=0: process 0 runs the engine"):
        run_follower(EngineArgs(**demo))


def test_processes_started_with_different_settings_are_refused_by_name(tmp_path):
    """A follower started with another --max-num-seqs and --scan-layers would compile other
    programs and hang the leader at its first step: every process refuses to start, naming both."""
    save_hf_model("llama_tp", str(tmp_path))
    options = tp_workload.engine_options(str(tmp_path), 4)
    other = {**options, "max_num_seqs": 2, "scan_layers": True, "compile_threads": 1}  # the last one may differ
    for code, _, err in run_processes([options, other], [[5, 6, 7]]):
        assert code != 0 and "EngineArgsError" in err, err[-4000:]
        assert "different from process 0: max_num_seqs on process(es) 1; scan_layers on process(es) 1" in err
        assert "compile_threads" not in err.splitlines()[-1]


def test_every_process_takes_the_leaders_seed(tmp_path):
    """Dummy weights come from the seed: a follower started with another seed (or none) makes its
    shards from process 0's, so the two processes compute what one process with 4 devices does."""
    save_hf_model("llama_tp", str(tmp_path))
    prompts = tp_workload.prompts(seed=2)[:3]
    options = {**tp_workload.engine_options(str(tmp_path), 4), "load_format": "dummy", "seed": 3}
    leader, follower = run_processes([options, {**options, "seed": None}], prompts)
    assert leader[0] == 0 and follower[0] == 0, leader[2][-3000:] + follower[2][-3000:]
    ((code, out, err),) = run_processes([options], prompts, devices=4)
    assert code == 0, err[-4000:]
    assert last_json(leader[1])["tokens"] == last_json(out)["tokens"]
