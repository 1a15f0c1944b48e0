"""`jaxpaged bench`'s command line: every flag has help, bad input is named by its flag before JAX
loads (exit 2), and `bench plot` draws saved serve results."""

import json
import os
import subprocess
import sys

from jaxpaged.bench.cli import COMMANDS
from jaxpaged.cli import build_parser, main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BAD_INPUT = [
    (["serve", "--goodput", "ttft"], "--goodput 'ttft': write METRIC:MILLISECONDS"),
    (["serve", "--goodput", "itl:50"], "--goodput 'itl:50': the metric must be one of ttft, tpot, e2el"),
    (["serve", "--percentile-metrics", "ttft,foo"], "--percentile-metrics 'ttft,foo': choose from"),
    (["serve", "--metric-percentiles", "150"], "--metric-percentiles '150': give percentiles in [0, 100]"),
    (["serve", "--request-rate", "0"], "a request rate must be positive"),
    (["serve", "--max-concurrency", "0"], "--max-concurrency 0: must be at least 1"),
    (["serve", "--dataset-name", "random", "--endpoint", "/v1/chat/completions"], "use --endpoint /v1/completions"),
    (["throughput", "--dataset-name", "random", "--prefix-len", "9"], "--prefix-len applies to --dataset-name prefix"),
    (["throughput", "--dataset-name", "random", "--input-len", "2000"], "more than the model context of 1024 tokens"),
    (["throughput", "--suffix-len", "300,100"], "'300,100': need 1 <= MIN <= MAX"),
    (["throughput", "--max-num-seqs", "0"], "--max-num-seqs 0: must be an integer of at least 1"),
    (["throughput", "--transformers-timeout", "0"], "--transformers-timeout 0.0: must be positive"),
    (["throughput", "--n", "2", "--compare-transformers"], "generates one sequence per prompt; drop --n 2"),
    (["throughput", "--dataset-name", "random", "--random-range-ratio", "1.5"], "--random-range-ratio 1.5: must be in"),
    (["serve", "--backend", "openai-chat", "--endpoint", "/v1/completions"], "does not fit --backend openai-chat"),
    (["serve", "--num-warmups", "-1"], "--num-warmups -1: must be at least 0"),
    (["extraction", "--note-len", "9"], "--note-len '9': give MIN,MAX"),
    (["latency", "--batch-size", "0"], "--batch-size 0: must be at least 1"),
    (["latency", "--output-len", "2000"], "more than the model's context of 1024 tokens"),
    (["plot", "/no/such.json"], "/no/such.json: no such file"),
]


def test_bad_input_is_named_by_its_flag_before_jax_loads():
    # One interpreter for all cases: each must fail with exit 2 and its message, JAX never imported.
    code = (
        "import contextlib, io, json, sys\n"
        "from jaxpaged.cli import main\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        rc = main(['bench', *argv])\n"
        "    out.append([rc, err.getvalue()])\n"
        "print(json.dumps([out, 'jax' in sys.modules]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps([argv for argv, _ in BAD_INPUT])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results, jax_imported = json.loads(proc.stdout.splitlines()[-1])
    for (argv, message), (rc, stderr) in zip(BAD_INPUT, results):
        assert rc == 2 and message in stderr and "Traceback" not in stderr, (argv, rc, stderr)
    assert not jax_imported, "an error came after JAX was imported"


def test_every_bench_flag_has_help_with_its_default():
    bench = next(a for a in build_parser()._actions if a.dest == "command").choices["bench"]
    commands = next(a for a in bench._actions if a.dest == "bench_command").choices
    assert tuple(commands) == COMMANDS
    for name, sub in commands.items():
        for action in sub._actions:
            if action.dest == "help":
                continue
            help_text = sub.formatter_class(name)._get_help_string(action)
            assert help_text.strip(), f"bench {name} {action.option_strings} has no help"
            if action.option_strings and action.default not in (None, False):
                assert "default" in help_text, f"bench {name} {action.option_strings} does not show its default"
    latency = commands["latency"].parse_args([])
    assert latency.enable_prefix_caching is False and latency.batch_size == 1  # vLLM: iterations repeat the prompts


def serve_result(rate, throughput: float, ttft: float) -> dict:
    return {
        "model_id": "demo",
        "request_rate": rate,
        "request_throughput": throughput,
        "output_throughput": 100 * throughput,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft,
        "median_tpot_ms": 5.0,
        "p99_tpot_ms": 9.0,
        "median_itl_ms": 5.0,
        "p90_itl_ms": 7.0,
        "p99.9_itl_ms": 8.0,
        "median_e2el_ms": 900.0,
    }


def test_plot_draws_saved_results(tmp_path, capsys):
    paths = []
    for rate, throughput, ttft in ((1.0, 0.9, 40.0), (4.0, 3.1, 80.0), ("inf", 5.0, 900.0)):
        paths.append(str(tmp_path / f"r{rate}.json"))
        with open(paths[-1], "w") as f:
            json.dump(serve_result(rate, throughput, ttft), f)
    png = tmp_path / "chart.png"
    assert main(["bench", "plot", *paths, "--output", str(png), "--x", "output_throughput"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert "3 results, ttft, tpot, itl, e2el" in capsys.readouterr().err
    from jaxpaged.bench.plot import highest_percentile

    assert highest_percentile(serve_result(1, 1, 1), "itl") == "p99.9_itl_ms"
    (tmp_path / "bad.json").write_text('{"completed": 3}')
    assert main(["bench", "plot", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: not a bench serve result" in capsys.readouterr().err


def test_compare_transformers_without_torch_is_refused_before_the_run(monkeypatch, capsys):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find_spec(name, *a))
    assert main(["bench", "throughput", "--compare-transformers"]) == 2
    err = capsys.readouterr().err
    assert "--compare-transformers runs Hugging Face transformers, which needs torch: pip install torch" in err, err
