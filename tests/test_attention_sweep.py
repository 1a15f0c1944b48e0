"""`benchmarks/gpu/attention_sweep.py --smoke` runs on the CPU (interpret mode, tiny shapes, three
ragged and two decode configs) and writes the JSON the next GPU session reads; `--max-seconds`
stops it cleanly. The kernels' `tiles=` override itself is tested in test_kernels.py and
test_kernel_lowering.py.
"""

import json

from benchmarks.gpu import attention_sweep


def test_sweep_smoke_writes_every_case_and_refuses_a_bad_config(tmp_path):
    out = tmp_path / "sweep.json"
    assert attention_sweep.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["smoke"] is True and results["complete"] is True and results["stopped"] is None
    assert [c["case"] for c in results["cases"]] == ["prefill_40", "mixed_40", "decode_b2"]
    prefill, mixed, decode = results["cases"]
    for case in results["cases"]:
        assert case["default_s"] and case["baseline_s"] is not None
        assert case["configs"][0]["tiles"] == case["default_tiles"]  # the default always runs, first
        for entry in case["configs"]:
            assert set(entry) >= {"tiles", "status", "rel_err", "seconds", "rate", "x_default", "x_cudnn", "error"}
    assert prefill["flops"] == 4 * 8 * 64 * 40 * 41 // 2 and prefill["cudnn_s"] and prefill["cudnn_rel_err"] < 2e-2
    assert prefill["configs"][0]["x_default"] == 1.0 and prefill["configs"][0]["x_cudnn"] > 0
    ok = [e for e in prefill["configs"] if e["status"] == "ok"]
    assert len(ok) == 2 and all(e["rel_err"] < 2e-2 and e["rate"] > 0 for e in ok)
    [refused] = [e for e in prefill["configs"] if e["status"] == "failed"]
    assert refused["tiles"] == [8, 16, 4, 2] and "rows=8 must be an int >= 16" in refused["error"]
    # the mixed case carries the first case's fastest two configs (--top 2 in smoke): both that ran
    assert len(mixed["configs"]) == 2 and "cudnn_s" not in mixed
    assert decode["kernel"] == "decode" and all(e["status"] == "ok" and e["rate"] > 0 for e in decode["configs"])
    overall = results["ragged_overall"]  # configs timed in every ragged case, best geometric mean first
    assert sorted(r["tiles"] for r in overall) == sorted(e["tiles"] for e in mixed["configs"])
    assert [r["geomean_x_default"] for r in overall] == sorted((r["geomean_x_default"] for r in overall), reverse=True)


def test_sweep_stops_cleanly_at_max_seconds(tmp_path):
    out = tmp_path / "sweep.json"
    assert attention_sweep.main(["--smoke", "--max-seconds", "0", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["complete"] is False and results["cases"] == []
    assert results["stopped"] == "--max-seconds 0 reached before prefill_40"
