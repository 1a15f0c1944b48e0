"""`benchmarks/quantization_gpu.py` runs end to end on the CPU with `--smoke` (the demo model with
dummy weights, tiny shapes, the kernels in interpret mode), and its HLO census reads GPU-style HLO.

The real run needs a GPU (`bash benchmarks/run_gpu.sh quantization "$OUT"`); these keep it from
rotting: every stage and step in its own process, each step's JSON parsed into the summary, the
headlines (HLO counts per step and program, fp8/bf16 kernel times, engine ratios to bf16), the
markdown tables, the tarball with the HLO text; and the census on a hand-written module of the
shapes XLA's GPU compiler emits (cuBLASLt fp8 custom calls with their workspace, a Triton GEMM
fusion widening int8 in registers, a standalone weight-sized convert, a slice copy, an fp8
transpose).
"""

import json
import os
import tarfile

from gpu_script_smoke import run_script, smoke_run_fixture

from benchmarks.gpu.hlo_census import census

STAGES = ("hlo", "kernels", "engine")
HLO_STEPS = ("fp8", "int8", "bf16", "fp8_scanned_cublas_in_place")
ENGINE_MODES = ("bf16", "fp8_w_kv", "fp8_kv", "int8", "int4")
HLO_KEYS = {
    "fp8_gemm_custom_calls",
    "gemm_custom_calls",
    "gemm_fusions",
    "fp8_dots_in_gemm_fusions",
    "weight_upcasts",
    "weight_relayouts_8bit",
    "weight_slice_copies",
    "converts_in_gemm_fusions",
    "compile_s",
}


smoke_run = smoke_run_fixture("quantization_gpu", timeout=400)


def test_smoke_runs_every_stage_and_step(smoke_run):
    out, work, summary = smoke_run
    assert summary["device"]["platform"] == "cpu" and summary["device"]["jax_version"]
    assert summary["plan"]["smoke"] is True and list(summary["plan"]["engine_modes"]) == list(ENGINE_MODES)
    records = {r["stage"]: r for r in summary["stages"]}
    assert list(records) == list(STAGES)
    assert {name: r["status"] for name, r in records.items()} == {name: "ok" for name in STAGES}
    steps = {name: [s["name"] for s in r["steps"]] for name, r in records.items()}
    assert steps == {
        "hlo": list(HLO_STEPS),
        "kernels": ["fp8_vs_bf16"],
        "engine": [f"{kind}_{mode}" for mode in ENGINE_MODES for kind in ("latency", "throughput")],
    }
    for record in records.values():
        for step in record["steps"]:
            assert step["status"] == "ok" and step["returncode"] == 0 and step["result"], (
                record["stage"],
                step["name"],
            )
    assert sorted(os.listdir(out)) == ["console.txt", "stages.tar.gz", "summary.json", "summary.md"]
    for name in STAGES:  # each stage's own JSON is its summary record
        assert json.loads((work / f"{name}.json").read_text())["status"] == "ok"


def test_smoke_hlo_census_per_step_and_program(smoke_run):
    out, work, summary = smoke_run
    hlo = next(r for r in summary["stages"] if r["stage"] == "hlo")
    assert sorted(hlo["headline"]) == sorted(f"{step} decode:1" for step in HLO_STEPS)
    assert all(set(row) == HLO_KEYS for row in hlo["headline"].values())
    fp8 = hlo["steps"][0]["result"]
    assert fp8["quantization"] == "fp8" and fp8["kv_cache_dtype"] == "fp8" and "float8_e4m3fn" in fp8["weight_dtypes"]
    assert set(fp8["weight_sizes"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    program = fp8["programs"]["decode:1"]
    assert program["program"].startswith("decode step") and program["dots"]  # the projections' dots were found
    # XLA's CPU backend has no fp8 dot: it widens the float8 weights in memory, which the census sees
    assert program["weight_sized"]["upcasts"] > 0 and program["fp8_gemm_custom_calls"] == 0
    assert hlo["headline"]["bf16 decode:1"]["weight_upcasts"] == 0
    with tarfile.open(out / "stages.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"stages/hlo/hlo_{step}_decode1.txt" for step in HLO_STEPS} <= names
    assert {f"stages/{name}.{ext}" for name in STAGES for ext in ("json", "txt")} <= names
    assert not any("xla_cache" in name for name in names)
    dsf = next(s for s in hlo["steps"] if s["name"] == "fp8_scanned_cublas_in_place")
    assert dsf["cmd"][0] == "env" and "--xla_gpu_enable_dynamic_slice_fusion=true" in dsf["cmd"][1]


def test_smoke_kernels_and_engine_headlines(smoke_run):
    out, _, summary = smoke_run
    records = {r["stage"]: r for r in summary["stages"]}
    kernels = records["kernels"]["headline"]
    assert kernels["complete"] is True and kernels["checks"] >= 5 and kernels["max_rel_err"] < 2e-2
    assert list(kernels["time_fp8_over_bf16"]) == ["b=2 ctx=64"] and kernels["time_fp8_over_bf16"]["b=2 ctx=64"] > 0
    result = records["kernels"]["steps"][0]["result"]
    assert {c["name"].split()[0] for c in result["checks"]} == {"decode", "ragged"}
    assert any("float8_e5m2" in c["name"] for c in result["checks"])
    row = result["decode"][0]
    assert row["bf16"]["pool_dtype"] == "bfloat16" and row["fp8"]["pool_dtype"] == "float8_e4m3fn"
    assert row["fp8"]["kv_bytes"] * 2 == row["bf16"]["kv_bytes"] and row["fp8"]["s"] > 0
    engine = records["engine"]["headline"]
    assert list(engine) == list(ENGINE_MODES)
    for mode, numbers in engine.items():
        assert numbers["tpot_ms"] > 0 and numbers["output_tok_s"] > 0, mode
        assert numbers["tpot_vs_bf16"] > 0 and numbers["throughput_vs_bf16"] > 0, mode
    assert engine["bf16"]["tpot_vs_bf16"] == 1.0
    markdown = (out / "summary.md").read_text()
    assert all(f"| {name} | ok |" in markdown for name in STAGES)
    assert "| fp8_w_kv |" in markdown and "| fp8 decode:1 |" in markdown and "| 2 | 64 |" in markdown


def test_refuses_without_a_gpu(tmp_path):
    proc = run_script(
        "quantization_gpu", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), timeout=120
    )
    assert proc.returncode == 2 and "REFUSED" in proc.stdout
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["device"]["refused"] is True


# A module as XLA's GPU compiler prints it (shapes shrunk: weights of 1024 x 4096 and 4096 x 4096).
GPU_HLO = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[16,4096]{1,0})->bf16[16,4096]{1,0}}

%gemm_fusion_dot.1_computation (parameter_0: bf16[16,4096], parameter_1: s8[1024,4096]) -> bf16[16,1024] {
  %parameter_0 = bf16[16,4096]{1,0} parameter(0)
  %parameter_1 = s8[1024,4096]{1,0} parameter(1)
  %convert.1 = bf16[1024,4096]{1,0} convert(s8[1024,4096]{1,0} %parameter_1)
  ROOT %dot.1 = bf16[16,1024]{1,0} dot(bf16[16,4096]{1,0} %parameter_0, bf16[1024,4096]{1,0} %convert.1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}

%fused_convert (param_0.1: s8[4096,4096]) -> bf16[4096,4096] {
  %param_0.1 = s8[4096,4096]{1,0} parameter(0)
  ROOT %convert.2 = bf16[4096,4096]{1,0} convert(s8[4096,4096]{1,0} %param_0.1)
}

%fused_slice (param_0.2: f8e4m3fn[2,1024,4096], param_1.2: s32[]) -> f8e4m3fn[1024,4096] {
  %param_0.2 = f8e4m3fn[2,1024,4096]{2,1,0} parameter(0)
  %param_1.2 = s32[] parameter(1)
  %constant.0 = s32[] constant(0)
  %dynamic-slice.1 = f8e4m3fn[1,1024,4096]{2,1,0} dynamic-slice(f8e4m3fn[2,1024,4096]{2,1,0} %param_0.2, s32[] %param_1.2, s32[] %constant.0, s32[] %constant.0), dynamic_slice_sizes={1,1024,4096}
  ROOT %bitcast.1 = f8e4m3fn[1024,4096]{1,0} bitcast(f8e4m3fn[1,1024,4096]{2,1,0} %dynamic-slice.1)
}

%input_transpose (param_0.3: f8e4m3fn[4096,4096]) -> f8e4m3fn[4096,4096] {
  %param_0.3 = f8e4m3fn[4096,4096]{1,0} parameter(0)
  ROOT %transpose.1 = f8e4m3fn[4096,4096]{1,0} transpose(f8e4m3fn[4096,4096]{1,0} %param_0.3), dimensions={1,0}
}

ENTRY %main.9 (x: bf16[16,4096], w8: s8[1024,4096], w16: s8[4096,4096], xq: f8e4m3fn[16,4096], stacked: f8e4m3fn[2,1024,4096], wq: f8e4m3fn[4096,4096], i: s32[]) -> bf16[16,4096] {
  %x = bf16[16,4096]{1,0} parameter(0)
  %w8 = s8[1024,4096]{1,0} parameter(1)
  %w16 = s8[4096,4096]{1,0} parameter(2)
  %xq = f8e4m3fn[16,4096]{1,0} parameter(3)
  %stacked = f8e4m3fn[2,1024,4096]{2,1,0} parameter(4)
  %wq = f8e4m3fn[4096,4096]{1,0} parameter(5)
  %i = s32[] parameter(6)
  %one = f32[] constant(1)
  %gemm_fusion_dot.1 = bf16[16,1024]{1,0} fusion(bf16[16,4096]{1,0} %x, s8[1024,4096]{1,0} %w8), kind=kCustom, calls=%gemm_fusion_dot.1_computation, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"fusion_backend_config":{"kind":"__triton_gemm","triton_gemm_config":{"block_m":"16","block_n":"64","block_k":"128","split_k":"1","num_stages":"4","num_warps":"4","num_ctas":"1"}},"force_earliest_schedule":false}
  %loop_convert_fusion = bf16[4096,4096]{1,0} fusion(s8[4096,4096]{1,0} %w16), kind=kLoop, calls=%fused_convert, backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],"fusion_backend_config":{"kind":""},"force_earliest_schedule":false}
  %cublas-gemm.1 = (bf16[16,4096]{1,0}, s8[4194304]{0}) custom-call(bf16[16,4096]{1,0} %x, bf16[4096,4096]{1,0} %loop_convert_fusion), custom_call_target="__cublas$gemm", backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  %loop_dynamic_slice_fusion = f8e4m3fn[1024,4096]{1,0} fusion(f8e4m3fn[2,1024,4096]{2,1,0} %stacked, s32[] %i), kind=kLoop, calls=%fused_slice
  %input_transpose_fusion = f8e4m3fn[4096,4096]{1,0} fusion(f8e4m3fn[4096,4096]{1,0} %wq), kind=kInput, calls=%input_transpose
  %cublas-gemm.2 = (f32[16,1024]{1,0}, s8[33554432]{0}) custom-call(f8e4m3fn[16,4096]{1,0} %xq, f8e4m3fn[1024,4096]{1,0} %loop_dynamic_slice_fusion, f32[] %one, f32[] %one), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"epilogue":"DEFAULT"}}
  %cublas-gemm.3 = (f32[16,4096]{1,0}, s8[33554432]{0}) custom-call(%xq, %input_transpose_fusion, %one, %one), custom_call_target="__cublas$lt$matmul$f8"
  %gte = bf16[16,4096]{1,0} get-tuple-element((bf16[16,4096]{1,0}, s8[4194304]{0}) %cublas-gemm.1), index=0
  ROOT %t = bf16[16,4096]{1,0} add(bf16[16,4096]{1,0} %gte, bf16[16,4096]{1,0} %gte)
}
"""


def test_census_reads_gpu_hlo():
    found = census(GPU_HLO, {1024 * 4096, 4096 * 4096, 2 * 1024 * 4096})
    assert found["custom_calls"] == {"__cublas$lt$matmul$f8": 2, "__cublas$gemm": 1}
    assert found["fp8_gemm_custom_calls"] == 2 and found["gemm_custom_calls"] == 3 and found["gemm_fusions"] == 1
    assert found["fusions"] == {"kCustom:__triton_gemm": 1, "kLoop": 2, "kInput": 1}
    assert (
        found["gemms"]["custom-call __cublas$lt$matmul$f8: f8e4m3fn[16,4096] x f8e4m3fn[1024,4096] -> f32[16,1024]"]
        == 1
    )
    assert (
        found["gemms"]["fusion kCustom:__triton_gemm: bf16[16,4096] x s8[1024,4096] -> bf16[16,1024] (dot bf16 x bf16)"]
        == 1
    )
    assert found["dots"] == {"bf16 x bf16 -> bf16 in gemm fusion": 1}
    sized = found["weight_sized"]
    # the standalone convert, the slice copy, the fp8 transpose; not the 4 MiB cuBLAS workspace
    assert (sized["upcasts"], sized["slice_copies"], sized["relayouts_8bit"]) == (1, 1, 1)
    assert len(sized["materialized"]) == 3 and not any("custom-call" in k for k in sized["materialized"])
    assert sized["converts_in_gemm_fusions"] == 1  # int8 widened inside the Triton GEMM: the good case
    assert found["fp8_dots_in_gemm_fusions"] == 0
