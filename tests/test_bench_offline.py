"""`bench throughput` (with transformers in its own process) and `bench latency` end to end on the
demo model, with tiny engines: the reports' keys and counts."""

import json
import time

import numpy as np
import pytest

from jaxpaged.cli import main

# The same engine shapes in both tests: the second can load its programs from a compilation cache.
TINY_ENGINE = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "128", "--dtype", "float32"]


def test_throughput_on_sharegpt_against_transformers(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    argv = [
        "bench",
        "throughput",
        "--dataset-name",
        "sharegpt",
        "--num-prompts",
        "6",
        "--output-len",
        "8",
        "--compare-transformers",
        "--disable-tqdm",
        "--output-json",
        str(out),
        *TINY_ENGINE,
    ]
    start = time.perf_counter()
    assert main(argv) == 0
    wall = time.perf_counter() - start
    result = json.loads(out.read_text())
    assert (
        result["num_requests"] == 6 and result["total_output_tokens"] == 6 * 8 and result["dataset_name"] == "sharegpt"
    )
    prompt_tokens = result["total_num_tokens"] - result["total_output_tokens"]
    assert 6 * 4 <= prompt_tokens <= 6 * 120  # ShareGPT prompts that fit the 128-token context with 8 out
    # the timed part is inside the command: at least as many requests per second as over the whole call
    assert 0 < result["elapsed_time"] < wall and result["requests_per_second"] >= 6 / wall
    assert result["output_tokens_per_second"] > 0 and result["engine_sizes"] == {"max_model_len": 128}
    theirs = result["transformers"]
    assert (
        theirs["num_requests"] == 6
        and theirs["total_output_tokens"] == 48
        and theirs["total_num_tokens"] == result["total_num_tokens"]
    )
    assert "transformers" in theirs["backend"] and theirs["device"] == "cpu"
    # the same 48 output tokens on both sides: the ratio is the inverse ratio of their times
    ratio = result["output_throughput_vs_transformers"]
    assert ratio == pytest.approx(theirs["elapsed_time"] / result["elapsed_time"])
    printed = capsys.readouterr().out
    assert "requests/s" in printed and "output tokens/s" in printed and f"{ratio:.2f}x" in printed


def test_latency_of_a_fixed_batch(tmp_path, capsys):
    out = tmp_path / "latency.json"
    argv = [
        "bench",
        "latency",
        "--input-len",
        "8",
        "--output-len",
        "8",
        "--batch-size",
        "2",
        "--num-iters-warmup",
        "1",
        "--num-iters",
        "3",
        "--output-json",
        str(out),
        *TINY_ENGINE,
    ]
    start = time.perf_counter()
    assert main(argv) == 0
    wall = time.perf_counter() - start
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3 and result["batch_size"] == 2
    assert set(result["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])
    assert 0 < sum(result["latencies"]) < wall  # three timed iterations inside the call
    assert result["avg_time_per_output_token_ms"] == pytest.approx(np.mean(result["latencies"]) / 8 * 1000)
    assert "Avg latency:" in capsys.readouterr().out


def test_throughput_keeps_its_figure_when_transformers_times_out(tmp_path, capsys):
    out = tmp_path / "throughput.json"
    argv = [
        "bench",
        "throughput",
        "--dataset-name",
        "random",
        "--num-prompts",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "8",
        "--compare-transformers",
        "--transformers-timeout",
        "0.01",
        "--disable-tqdm",
        "--output-json",
        str(out),
        *TINY_ENGINE,
    ]
    assert main(argv) == 1  # the comparison asked for failed ...
    result = json.loads(out.read_text())  # ... and jaxpaged's own run is still measured and saved
    assert result["num_requests"] == 2 and result["total_output_tokens"] == 16 and "transformers" not in result
    assert "--transformers-timeout 0.01" in result["transformers_error"]
    assert "the transformers comparison failed" in capsys.readouterr().err
