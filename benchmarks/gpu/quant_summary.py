"""The summary of `benchmarks/quantization_gpu.py`: each stage's headline numbers, and summary.md's
tables after the stages' statuses, one per stage: the HLO census, the fp8 vs bf16 decode kernel,
the engine modes vs bf16 (files and plumbing: `gpu/summary.py`; the tarball holds the HLO text)."""

from benchmarks.gpu.summary import Summary, cell, markdown_head, rounded, step_result, steps_cell


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
    result = step_result(record, "fp8_vs_bf16") or {}
    errs = [c["rel_err"] for c in result.get("checks", []) if c.get("rel_err") is not None]
    rows = result.get("decode", [])
    ratios = {f"b={r['batch']} ctx={r['context']}": rounded(r.get("time_ratio_fp8_over_bf16")) for r in rows}
    best = {name: max((r[name]["GBps"] for r in rows if r[name].get("GBps")), default=None) for name in ("bf16", "fp8")}
    return {
        "complete": result.get("complete"),
        "checks": len(errs),
        "max_rel_err": max(errs, default=None),
        "hbm_copy_GBps": rounded(result["hbm_copy_Bps"] / 1e9, 0) if result.get("hbm_copy_Bps") else None,
        "best_bf16_GBps": rounded(best["bf16"], 0),
        "best_fp8_GBps": rounded(best["fp8"], 0),
        "time_fp8_over_bf16": ratios,
    }


def engine_headline(record: dict) -> dict:
    """Per mode: batch-1 TPOT and offline output tokens/s, and both as ratios to bf16's."""
    modes = []
    for step in record["steps"]:
        mode = step["name"].partition("_")[2]
        if mode not in modes:
            modes.append(mode)
    base_tpot = (step_result(record, "latency_bf16") or {}).get("avg_time_per_output_token_ms")
    base_tok = (step_result(record, "throughput_bf16") or {}).get("output_tokens_per_second")
    out = {}
    for mode in modes:
        tpot = (step_result(record, f"latency_{mode}") or {}).get("avg_time_per_output_token_ms")
        tok = (step_result(record, f"throughput_{mode}") or {}).get("output_tokens_per_second")
        out[mode] = {
            "tpot_ms": rounded(tpot),
            "output_tok_s": rounded(tok, 0),
            "tpot_vs_bf16": rounded(tpot / base_tpot, 3) if tpot and base_tpot else None,
            "throughput_vs_bf16": rounded(tok / base_tok, 3) if tok and base_tok else None,
        }
    return out


HEADLINES = {"hlo": hlo_headline, "kernels": kernels_headline, "engine": engine_headline}


def _cell(value) -> str:
    """A table cell; small floats (relative errors) in scientific notation."""
    if isinstance(value, float) and 0 < abs(value) < 0.01:
        return f"{value:.1e}"
    return cell(value)


def markdown(device: dict, records: list[dict], plan: dict) -> str:
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
            rows = (step_result(record, "fp8_vs_bf16") or {}).get("decode", [])
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
                    f"| {r['batch']} | {r['context']} | {_cell(us['bf16'])} | {_cell(rounded(r['bf16']['GBps'], 0))} "
                    f"| {_cell(us['fp8'])} | {_cell(rounded(r['fp8']['GBps'], 0))} | "
                    f"{_cell(rounded(r['time_ratio_fp8_over_bf16']))} |"
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


SUMMARY = Summary(lambda record, records: HEADLINES[record["stage"]](record), markdown)
