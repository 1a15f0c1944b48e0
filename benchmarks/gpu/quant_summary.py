"""The summary of `benchmarks/quantization_gpu.py`, rewritten after every stage: `summary.json`
(the device, the plan, every stage's record with its headline) and `summary.md` (the stages'
statuses, then one table per stage: the HLO census, fp8 vs bf16 decode kernel, engine modes vs
bf16), and `stages.tar.gz` (each stage's JSON and log, the HLO text files)."""

from benchmarks.gpu.summary import _round, markdown_head, set_headlines, steps_cell, write_files


def _result(record: dict, step_name: str) -> dict | None:
    return next((s["result"] for s in record["steps"] if s["name"] == step_name and s["result"]), None)


def hlo_headline(record: dict) -> dict:
    """Per HLO step (fp8, int8, bf16, ...) and program: the GEMMs and the weight-sized buffers."""
    out = {}
    for step in record["steps"]:
        result = step["result"] or {}
        for spec, found in (result.get("programs") or {}).items():
            sized = found["weight_sized"]
            out[f"{step['name']} {spec}"] = {
                "fp8_gemm_custom_calls": found["fp8_gemm_custom_calls"],
                "gemm_custom_calls": found["gemm_custom_calls"],
                "gemm_fusions": found["gemm_fusions"],
                "fp8_dots_in_gemm_fusions": found["fp8_dots_in_gemm_fusions"],
                "weight_upcasts": sized["upcasts"],
                "weight_relayouts_8bit": sized["relayouts_8bit"],
                "weight_slice_copies": sized["slice_copies"],
                "converts_in_gemm_fusions": sized["converts_in_gemm_fusions"],
                "compile_s": found["compile_s"],
            }
    return out


def kernels_headline(record: dict) -> dict:
    result = _result(record, "fp8_vs_bf16") or {}
    errs = [c["rel_err"] for c in result.get("checks", []) if c.get("rel_err") is not None]
    rows = result.get("decode", [])
    ratios = {f"b={r['batch']} ctx={r['context']}": _round(r.get("time_ratio_fp8_over_bf16")) for r in rows}
    best = {name: max((r[name]["GBps"] for r in rows if r[name].get("GBps")), default=None) for name in ("bf16", "fp8")}
    return {
        "complete": result.get("complete"),
        "checks": len(errs),
        "max_rel_err": max(errs, default=None),
        "hbm_copy_GBps": _round(result["hbm_copy_Bps"] / 1e9, 0) if result.get("hbm_copy_Bps") else None,
        "best_bf16_GBps": _round(best["bf16"], 0),
        "best_fp8_GBps": _round(best["fp8"], 0),
        "time_fp8_over_bf16": ratios,
    }


def engine_headline(record: dict) -> dict:
    """Per mode: batch-1 TPOT and offline output tokens/s, and both as ratios to bf16's."""
    modes = []
    for step in record["steps"]:
        mode = step["name"].partition("_")[2]
        if mode not in modes:
            modes.append(mode)
    base_tpot = (_result(record, "latency_bf16") or {}).get("avg_time_per_output_token_ms")
    base_tok = (_result(record, "throughput_bf16") or {}).get("output_tokens_per_second")
    out = {}
    for mode in modes:
        tpot = (_result(record, f"latency_{mode}") or {}).get("avg_time_per_output_token_ms")
        tok = (_result(record, f"throughput_{mode}") or {}).get("output_tokens_per_second")
        out[mode] = {
            "tpot_ms": _round(tpot),
            "output_tok_s": _round(tok, 0),
            "tpot_vs_bf16": _round(tpot / base_tpot, 3) if tpot and base_tpot else None,
            "throughput_vs_bf16": _round(tok / base_tok, 3) if tok and base_tok else None,
        }
    return out


HEADLINES = {"hlo": hlo_headline, "kernels": kernels_headline, "engine": engine_headline}


def write_summary(out_dir: str, work_dir: str, device: dict, records: list[dict], plan: dict) -> None:
    """summary.json, summary.md and stages.tar.gz (the work directory without compilation caches)."""
    set_headlines(records, lambda record: HEADLINES[record["stage"]](record))
    write_files(out_dir, work_dir, {"device": device, "plan": plan, "stages": records}, markdown(device, records))


def _cell(value) -> str:
    if isinstance(value, float) and 0 < abs(value) < 0.01:
        return f"{value:.1e}"
    return "-" if value is None else str(value)


def markdown(device: dict, records: list[dict]) -> str:
    lines = markdown_head("Quantization GPU run", device, records, "steps", steps_cell)
    for record in records:
        headline = record.get("headline") or {}
        if "error" in headline:
            lines += ["", f"{record['stage']}: headline error {headline['error']}"]
        elif record["stage"] == "hlo" and headline:
            lines += [
                "",
                "## Compiled HLO of the step programs (counts)",
                "",
                "| step, program | fp8 GEMM custom calls | GEMM custom calls | GEMM fusions | fp8 dots in GEMM "
                "fusions | weight-sized upcasts | 8-bit weight relayouts | weight slice copies | converts in "
                "GEMM fusions | compile s |",
                "|---|---|---|---|---|---|---|---|---|---|",
            ]
            lines += [
                f"| {key} | " + " | ".join(_cell(v) for v in row.values()) + " |" for key, row in headline.items()
            ]
        elif record["stage"] == "kernels" and headline:
            rows = (_result(record, "fp8_vs_bf16") or {}).get("decode", [])
            lines += [
                "",
                f"## Decode kernel, bf16 vs float8_e4m3fn pool ({headline['checks']} checks, max rel err "
                f"{_cell(headline['max_rel_err'])}; measured HBM {_cell(headline['hbm_copy_GBps'])} GB/s)",
                "",
                "| batch | context | bf16 µs | bf16 GB/s | fp8 µs | fp8 GB/s | fp8/bf16 time |",
                "|---|---|---|---|---|---|---|",
            ]
            for r in rows:
                us = {n: None if r[n]["s"] is None else round(r[n]["s"] * 1e6, 1) for n in ("bf16", "fp8")}
                lines.append(
                    f"| {r['batch']} | {r['context']} | {_cell(us['bf16'])} | {_cell(_round(r['bf16']['GBps'], 0))} "
                    f"| {_cell(us['fp8'])} | {_cell(_round(r['fp8']['GBps'], 0))} | "
                    f"{_cell(_round(r['time_ratio_fp8_over_bf16']))} |"
                )
        elif record["stage"] == "engine" and headline:
            lines += [
                "",
                "## 8B engine (dummy weights): batch-1 TPOT and offline throughput",
                "",
                "| mode | TPOT ms | TPOT vs bf16 | output tok/s | throughput vs bf16 |",
                "|---|---|---|---|---|",
            ]
            lines += [
                f"| {mode} | "
                + " | ".join(_cell(row[k]) for k in ("tpot_ms", "tpot_vs_bf16", "output_tok_s", "throughput_vs_bf16"))
                + " |"
                for mode, row in headline.items()
            ]
    return "\n".join(lines) + "\n"
