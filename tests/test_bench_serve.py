"""`bench serve` against a real `jaxpaged serve` (the demo model, one tiny engine shared by the
module): every request succeeds, the saved JSON carries vLLM's keys and consistent counts, and
the client never imports JAX."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_KEYS = (
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "errors",
    "duration",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "model_id",
)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("bench_serve") / "serve.log"
    cmd = [
        sys.executable,
        "-m",
        "jaxpaged.cli",
        "serve",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "32",
        "--uvicorn-log-level",
        "warning",
    ]
    with open(log_path, "w+") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "JAX_PLATFORMS": "cpu"}
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 180
            while True:
                assert proc.poll() is None, log_path.read_text()
                try:
                    if httpx.get(url + "/health", trust_env=False).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.time() < deadline, "jaxpaged serve did not start:\n" + log_path.read_text()
                time.sleep(0.25)
            yield url
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def bench_serve(*argv: str) -> tuple[subprocess.CompletedProcess, bool]:
    """`jaxpaged bench serve ARGV` in a fresh interpreter; also whether it imported JAX."""
    code = (
        "import sys; from jaxpaged.cli import main; rc = main(sys.argv[1:]); "
        "print('JAX_IMPORTED' if 'jax' in sys.modules else 'NO_JAX', file=sys.stderr); sys.exit(rc)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, "bench", "serve", "--disable-tqdm", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc, "NO_JAX" not in proc.stderr


def test_sharegpt_at_full_rate_saves_vllms_keys(server_url, tmp_path):
    proc, jax_imported = bench_serve(
        "--base-url",
        server_url,
        "--dataset-name",
        "sharegpt",
        "--num-prompts",
        "8",
        "--output-len",
        "12",
        "--ignore-eos",
        "--max-concurrency",
        "3",
        "--goodput",
        "ttft:100000",
        "e2el:100000",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "run.json",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not jax_imported, "bench serve imported JAX"
    result = json.loads((tmp_path / "run.json").read_text())
    assert all(k in result for k in VLLM_KEYS), [k for k in VLLM_KEYS if k not in result]
    assert (result["completed"], result["failed"], result["num_prompts"]) == (8, 0, 8)
    assert result["errors"] == [""] * 8 and result["output_lens"] == [12] * 8 and result["total_output_tokens"] == 96
    assert result["total_input_tokens"] == sum(result["input_lens"]) and min(result["input_lens"]) >= 4
    assert result["model_id"] == "jaxpaged-demo" and result["request_rate"] == "inf" and result["max_concurrency"] == 3
    assert result["request_goodput"] == result["request_throughput"]  # generous SLOs: every request is good
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < result[f"median_{metric}_ms"] <= result[f"p99_{metric}_ms"], metric
    assert all(0 < t < e for t, e in zip(result["ttfts"], result["latencies"]))
    assert (
        "Successful requests:                     8" in proc.stdout
        and "Failed requests:                         0" in proc.stdout
    )


def test_prefix_dataset_at_a_poisson_rate(server_url, tmp_path):
    proc, _ = bench_serve(
        "--base-url",
        server_url,
        "--dataset-name",
        "prefix",
        "--num-prompts",
        "6",
        "--prefix-len",
        "64",
        "--suffix-len",
        "8,24",
        "--output-len",
        "6",
        "--request-rate",
        "20",
        "--burstiness",
        "0.5",
        "--percentile-metrics",
        "ttft,e2el",
        "--metric-percentiles",
        "50,90",
        "--backend",  # vLLM's flags: the completions API, two untimed requests first, a label on the file
        "openai",
        "--num-warmups",
        "2",
        "--label",
        "prefix-run",
        "--save-result",
        "--result-dir",
        str(tmp_path),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (saved,) = tmp_path.glob("prefix-run-20qps-*.json")
    result = json.loads(saved.read_text())
    assert result["label"] == "prefix-run" and result["backend"] == "openai" and result["completed"] == 6
    assert not any(key in result for key in ("ttfts", "itls", "generated_texts"))  # without --save-detailed
    assert "2 warm-up requests" in proc.stderr
    out = proc.stdout
    assert (
        "Successful requests:                     6" in out and "Request rate configured (RPS):           20.00" in out
    )
    assert "Total generated tokens:                  36" in out  # ignore_eos: every request its --output-len
    assert "P90 TTFT (ms):" in out and "P50 E2EL (ms):" in out and "TPOT" not in out
