"""The GPU scripts run end to end on the CPU with `--smoke` (interpret mode, the demo model, tiny shapes).

The real runs need a GPU; these keep the scripts from rotting:
- `benchmarks/kernels_gpu.py`, as gpu_run.py's kernels stage runs it: its bandwidth probe,
  correctness checks, timing loops, peers (JAX's Pallas paged attention is lowered for CUDA, not
  run), table and JSON; then the stage's `benchmarks/kv_transfer_bandwidth.py` on tiny shapes,
  every copy path reported (one run serves both: it was also run on its own before);
- `benchmarks/gpu_run.py`: the ShareGPT preparation, then every stage in its own processes, each
  stage's JSON and log, the summary after every stage, and a stage out of time recorded as such
  while the later stages still run;
- `benchmarks/throughput_steps.py` (a CPU analysis, not a GPU script): `bench throughput` with
  its steps timed by program;
- `benchmarks/run_gpu.sh`, the one entry point of the GPU suites: each suite's script reached.
"""

import functools
import json
import os
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_gpu_script(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_run", *argv],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_kernel_benchmark_smoke(tmp_path):
    """`kernels_gpu.py --smoke` as the orchestrator's kernels stage runs it."""
    out, work = tmp_path / "out", tmp_path / "work"
    proc = run_gpu_script("--smoke", "--stages", "kernels", "--out", str(out), "--work-dir", str(work), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [record] = json.loads((out / "summary.json").read_text())["stages"]
    assert record["stage"] == "kernels" and record["status"] == "ok"
    results = json.loads((work / "kernels_result.json").read_text())
    assert results["smoke"] is True
    assert results["checks"] and all(c["ok"] for c in results["checks"])
    assert results["complete"] is True and results["hbm_copy_Bps"] > 0
    assert any("IEEE dots" in c["name"] for c in results["checks"])  # f32 checked with and without TF32 dots
    decode = results["decode"][0]
    assert decode["ours_s"] is not None and decode["frac_of_measured_hbm"] > 0
    assert results["prefill"] and results["prefill"][0]["ours_TFLOPs"] > 0
    assert (
        record["headline"]["kv_offload_GBps"] > 0 and record["headline"]["kv_load_GBps"] > 0
    )  # the host tier's copies
    assert record["headline"]["checks"] == len(results["checks"]) and record["headline"]["best_decode"]
    # the stage's second step, `kv_transfer_bandwidth.py --blocks 8 --repeats 1` on the demo model
    transfer = json.loads((work / "kv_transfer_result.json").read_text())
    assert set(transfer["GB_per_s"]) == {"offload", "load", "device_get", "device_put", "to_pinned"}
    assert all(rate > 0 for rate in transfer["GB_per_s"].values()) and transfer["memory_kind"] == "pinned_host"
    assert transfer["bytes"] == 8 * transfer["block_bytes"]


STAGES = ("kernels", "startup", "engine_start", "latency", "throughput", "serve")
HEADLINE_KEYS = {
    "startup": {"programs", "cold_s", "warm_s"},
    "engine_start": {"cold_ready_s", "warm_ready_s", "cold_first_generate_s"},
    "latency": {
        "tpot_ms",
        "avg_latency_s",
        "tpot_ms_sync",
        "tpot_ms_one_step",
        "tpot_ms_scanned",
        "tpot_ms_scanned_cublas_in_place",
    },
    "throughput": {"requests", "output_tok_s", "requests_s", "transformers_output_tok_s", "vs_transformers"},
}


def test_gpu_run_smoke_runs_every_stage_and_records_a_timeout(tmp_path):
    dataset = tmp_path / "sharegpt.json"
    proc = run_gpu_script(
        "--prepare-dataset", "--dataset-path", str(dataset), "--dataset-num-prompts", "50", timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    conversations = json.loads(dataset.read_text())
    assert len(conversations) == 50 and all(len(c["conversations"]) == 2 for c in conversations)
    assert sorted(os.listdir(tmp_path / "llama3_tokenizer")) == ["tokenizer.json", "tokenizer_config.json"]

    out, work = tmp_path / "out", tmp_path / "work"
    # kernels gets one second (it needs ~45 s in interpret mode): it must be cut off, and
    # every later stage must still run
    proc = run_gpu_script(
        "--smoke",
        "--out",
        str(out),
        "--work-dir",
        str(work),
        "--dataset-path",
        str(dataset),
        "--budget",
        "kernels=1",
        timeout=400,
    )
    assert proc.returncode == 1, proc.stdout[-5000:] + proc.stderr[-3000:]  # 1: not every stage ok
    summary = json.loads((out / "summary.json").read_text())
    assert summary["device"]["platform"] == "cpu" and summary["device"]["jax_version"]
    records = {r["stage"]: r for r in summary["stages"]}
    assert list(records) == list(STAGES)
    assert {name: r["status"] for name, r in records.items()} == {
        "kernels": "timed_out",
        **{s: "ok" for s in STAGES[1:]},
    }
    kernels = records["kernels"]["steps"][0]
    # killed by its stage's timeout (no exit code of its own), which was the one second it was given
    assert kernels["status"] == "timed_out" and kernels["returncode"] is None and records["kernels"]["allowed_s"] <= 1
    for name, keys in HEADLINE_KEYS.items():
        assert keys <= set(records[name]["headline"]), name
    assert records["startup"]["headline"]["cold_s"] > 0 and records["latency"]["headline"]["tpot_ms"] > 0
    latency = records["latency"]["headline"]
    assert all(latency[f"tpot_ms_{name}"] > 0 for name in ("sync", "one_step", "scanned", "scanned_cublas_in_place"))
    assert records["throughput"]["headline"]["output_tok_s"] > 0
    assert sorted(records["serve"]["headline"]) == ["rate 16.0", "rate 4.0", "rate inf"]
    markdown = (out / "summary.md").read_text()
    assert all(f"| {name} | {records[name]['status']} |" in markdown for name in STAGES)
    assert sorted(os.listdir(out)) == ["console.txt", "stages.tar.gz", "summary.json", "summary.md"]
    with tarfile.open(out / "stages.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"stages/{name}.{ext}" for name in STAGES for ext in ("json", "txt")} <= names
    assert "stages/serve_results/latency_vs_throughput.png" in names
    for name in STAGES:  # each stage's own JSON is its summary record
        assert json.loads((work / f"{name}.json").read_text())["status"] == records[name]["status"]
    assert "timed_out" in (work / "kernels.txt").read_text()


def test_gpu_run_refuses_without_a_gpu(tmp_path):
    proc = run_gpu_script("--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), timeout=120)
    assert proc.returncode == 2 and "REFUSED" in proc.stdout
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["device"]["refused"] is True


def test_kv_tiers_benchmark_runs_its_configurations_in_processes(tmp_path):
    """`benchmarks/kv_tiers.py` on tiny prompts: a configuration without the disk and the fresh
    process over a disk an earlier process filled (which then serves the prefixes' first visits)."""
    out = tmp_path / "tiers.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.kv_tiers",
            "--configs",
            "small-pool+host,fresh+disk",
            "--num-prompts",
            "6",
            "--num-prefixes",
            "2",
            "--prefix-len",
            "64",
            "--suffix-len",
            "4,8",
            "--output-len",
            "2",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["small-pool+host", "warm-disk", "fresh+disk"]
    assert runs["warm-disk"]["disk_write_bytes"] > 0
    assert runs["fresh+disk"]["disk_hit_tokens"] >= 2 * 64  # both prefixes' full blocks at their first visit
    assert all(r["ttft_repeat_ms"]["mean"] > 0 for r in runs.values())
    assert "fresh+disk" in proc.stdout


def test_throughput_steps_reports_every_step_by_program(tmp_path):
    """`benchmarks/throughput_steps.py`: `bench throughput` with every engine step timed, grouped by
    the program that ran it; the steps' tokens add up to the workload's."""
    out = tmp_path / "steps.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.throughput_steps",
            "--output",
            str(out),
            "--",
            "bench",
            "throughput",
            "--dataset-name",
            "random",
            "--num-prompts",
            "3",
            "--input-len",
            "20",
            "--output-len",
            "9",
            "--max-model-len",
            "48",
            "--num-scheduler-steps",
            "4",
            "--disable-tqdm",
        ],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["command"][:3] == ["jaxpaged", "bench", "throughput"]
    rows = {r["program"]: r for r in summary["programs"]}
    assert "mixed 64 tokens x 1" in rows and any(p.startswith("decode") and p.endswith("x 4") for p in rows)
    assert sum(r["steps"] for r in rows.values()) == summary["steps"]
    # the 3 prompts' 20 tokens each go through mixed steps, every later token through decode ones
    prefill = sum(r["tokens_per_step"] * r["steps"] for p, r in rows.items() if p.startswith("mixed"))
    assert prefill == 60
    assert 0 < summary["wait_seconds"] <= summary["step_seconds"]


VLLM_STAGES = ("mixed_kernels", "engine_start", "throughput", "latency", "serve", "profile")


def test_vllm_run_smoke_runs_every_stage(tmp_path):
    """`benchmarks/vllm_gpu.py --smoke`: vLLM's sample prepared, then every stage of the one call
    (both kernels of a mixed step, the engine cold and warm, the sample offline, batch-1 TPOT,
    streamed serving at two rates with ITL, a profiled step's packed trace) on the demo model."""
    dataset = tmp_path / "sharegpt.json"
    run = functools.partial(
        subprocess.run, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True
    )
    script = [sys.executable, "-m", "benchmarks.vllm_gpu"]
    proc = run(
        [*script, "--prepare-dataset", "--dataset-path", str(dataset), "--dataset-num-prompts", "20"], timeout=120
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out, work = tmp_path / "out", tmp_path / "work"
    proc = run(
        [*script, "--smoke", "--out", str(out), "--work-dir", str(work), "--dataset-path", str(dataset)], timeout=900
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    records = {r["stage"]: r for r in json.loads((out / "summary.json").read_text())["stages"]}
    assert list(records) == list(VLLM_STAGES) and all(r["status"] == "ok" for r in records.values())
    heads = {name: r["headline"] for name, r in records.items()}
    assert list(heads["mixed_kernels"]) == ["4-decodes+2-prompts"]
    assert heads["throughput"]["requests"] == 4 and heads["throughput"]["output_tokens"] == 32
    assert heads["latency"]["tpot_ms"] > 0 and heads["engine_start"]["cold_ready_s"] > 0
    assert sorted(heads["serve"]) == ["rate 16.0", "rate inf"] and all("ITL p50" in v for v in heads["serve"].values())
    profile = json.loads((work / "profile_steps.json").read_text())
    assert len(profile["steps"]) == 2 and all(s["host_s"] > 0 and s["tokens"] >= 1 for s in profile["steps"])
    with tarfile.open(work / "profile_trace.tar.gz") as tar:
        assert any(name.endswith(".xplane.pb") for name in tar.getnames())
    assert not (work / "profile_trace").exists()
    mixed = json.loads((work / "mixed_attention.json").read_text())
    assert mixed["complete"] and all(c["ok"] for c in mixed["checks"]) and len(mixed["checks"]) == 4
    assert [row["case"] for row in mixed["decode_order"]] == ["6-varied"]
    assert all(row["speedup"] > 0 for row in mixed["decode_order"])


def test_vllm_run_refuses_without_a_gpu(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.vllm_gpu",
            "--out",
            str(tmp_path / "out"),
            "--work-dir",
            str(tmp_path / "w"),
        ],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "REFUSED" in proc.stdout


def test_the_one_gpu_entry_point_runs_each_suite_and_refuses_others():
    """`benchmarks/run_gpu.sh SUITE OUT [flags]` runs each suite's script with `--out OUT` and the
    flags (here `--help`: each prints its own usage); an unknown suite exits 2, naming the four."""
    env = dict(os.environ, PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")
    script = os.path.join(ROOT, "benchmarks", "run_gpu.sh")
    for suite, module in [
        ("vllm", "vllm_gpu"),
        ("engine", "gpu_run"),
        ("quantization", "quantization_gpu"),
        ("speculative", "speculative_gpu"),
    ]:
        proc = subprocess.run(["bash", script, suite, "/tmp/unused", "--help"], env=env, capture_output=True, text=True)
        assert proc.returncode == 0 and proc.stdout.startswith(f"usage: {module}.py"), (suite, proc.stderr)
    proc = subprocess.run(["bash", script, "everything"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "vllm, engine, quantization or speculative" in proc.stderr
