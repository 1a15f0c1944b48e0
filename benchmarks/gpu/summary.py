"""The run's summary, rewritten after every stage: `summary.json` (the device, every stage's
record) and `summary.md` (one table of each stage's status and headline numbers)."""

import json
import os
import tarfile


def _first_result(record: dict, *step_names: str) -> dict | None:
    for step in record["steps"]:
        if step["name"] in step_names and step["result"]:
            return step["result"]
    return None


def _round(value, digits: int = 2):
    return None if value is None else round(value, digits)


def kernels_headline(record: dict) -> dict:
    result = _first_result(record, "kernels") or {}
    errs = [c["rel_err"] for c in result.get("checks", []) if c.get("rel_err") is not None]
    decode = [r for r in result.get("decode", []) if r.get("frac_of_measured_hbm") is not None]
    best = max(decode, key=lambda r: r["frac_of_measured_hbm"], default=None)
    prefill = [r for r in result.get("prefill", []) if r.get("ours_TFLOPs") is not None]
    longest = max(prefill, key=lambda r: r["tokens"], default=None)
    kv = (_first_result(record, "kv_transfer") or {}).get("GB_per_s", {})
    return {
        "kv_offload_GBps": _round(kv.get("offload"), 1),
        "kv_load_GBps": _round(kv.get("load"), 1),
        "device_get_GBps": _round(kv.get("device_get"), 1),
        "device_put_GBps": _round(kv.get("device_put"), 1),
        "hbm_copy_GBps": _round(result["hbm_copy_Bps"] / 1e9, 0) if result.get("hbm_copy_Bps") else None,
        "checks": len(errs),
        "max_rel_err": max(errs, default=None),
        "complete": result.get("complete"),
        "best_decode": None
        if best is None
        else f"b={best['batch']} ctx={best['context']}: {best['ours_GBps']:.0f} GB/s "
        f"= {100 * best['frac_of_measured_hbm']:.0f}% of measured HBM"
        + (f", {best['jax_pallas_s'] / best['ours_s']:.2f}x JAX's paged_attention" if best.get("jax_pallas_s") else ""),
        "prefill_longest": None
        if longest is None
        else f"T={longest['tokens']}: {longest['ours_TFLOPs']:.1f} TFLOP/s"
        + (f" (sdpa {longest['sdpa_TFLOPs']:.1f})" if longest.get("sdpa_TFLOPs") else ""),
    }


def startup_headline(record: dict) -> dict:
    cold, warm = _first_result(record, "cold") or {}, _first_result(record, "warm") or {}
    return {"programs": cold.get("num_programs"), "cold_s": cold.get("wall_s"), "warm_s": warm.get("wall_s")}


def engine_start_headline(record: dict) -> dict:
    cold, warm = _first_result(record, "cold") or {}, _first_result(record, "warm") or {}
    return {
        "cold_ready_s": cold.get("ready_s"),
        "warm_ready_s": warm.get("ready_s"),
        "cold_first_generate_s": cold.get("first_generate_s"),
    }


def latency_headline(record: dict) -> dict:
    result = _first_result(record, "batch1") or {}
    tpot = {
        name: _round((_first_result(record, f"batch1_{name}") or {}).get("avg_time_per_output_token_ms"))
        for name in ("scanned", "scanned_cublas_in_place")
    }
    return {
        "tpot_ms": _round(result.get("avg_time_per_output_token_ms")),
        "avg_latency_s": _round(result.get("avg_latency"), 3),
        **{f"tpot_ms_{name}": value for name, value in tpot.items()},
    }


def throughput_headline(record: dict) -> dict:
    result = _first_result(record, "vs_transformers", "jaxpaged_only") or {}
    theirs = result.get("transformers") or {}
    return {
        "requests": result.get("num_requests"),
        "output_tok_s": _round(result.get("output_tokens_per_second"), 0),
        "requests_s": _round(result.get("requests_per_second")),
        "transformers_output_tok_s": _round(theirs.get("output_tokens_per_second"), 0),
        "vs_transformers": _round(result.get("output_throughput_vs_transformers")),
    }


def serve_headline(record: dict) -> dict:
    result = _first_result(record, "three_rates") or {}
    return {
        f"rate {r['request_rate']}": f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.0f} tok/s, "
        f"TTFT p50 {r['median_ttft_ms']:.0f} ms, TPOT p50 {r['median_tpot_ms']:.1f} ms"
        for r in result.get("runs", [])
    }


HEADLINES = {
    "kernels": kernels_headline,
    "startup": startup_headline,
    "engine_start": engine_start_headline,
    "latency": latency_headline,
    "throughput": throughput_headline,
    "serve": serve_headline,
}


def set_headlines(records: list[dict], headline_of) -> None:
    """Sets each record's headline to `headline_of(record)`; a partial result's error becomes its headline."""
    for record in records:
        try:
            record["headline"] = headline_of(record)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:  # a partial result: say so, go on
            record["headline"] = {"error": f"{type(err).__name__}: {err}"}


def write_files(out_dir: str, work_dir: str, summary: dict, markdown_text: str) -> None:
    """Writes OUT/summary.json and OUT/summary.md, and packs the work directory's stage files (not
    the compilation caches) into OUT/stages.tar.gz (a device call returns at most 8 files)."""
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(markdown_text)
    with tarfile.open(os.path.join(out_dir, "stages.tar.gz"), "w:gz") as tar:
        for name in sorted(os.listdir(work_dir)):
            if not name.endswith("_xla_cache"):
                tar.add(os.path.join(work_dir, name), arcname=os.path.join("stages", name))


def markdown_head(title: str, device: dict, records: list[dict], column: str, cell) -> list[str]:
    """The summary.md lines every run starts with: `title` and the device, REFUSED and why where the
    run was refused, then one table row per stage (status, seconds, `column` = `cell(record)`)."""
    lines = [
        f"# {title}: {device.get('name') or device.get('device_kind')}",
        "",
        f"jax {device.get('jax_version')}, platform {device.get('platform')}; {device.get('nvidia_smi') or ''}",
        "",
        f"| stage | status | seconds | {column} |",
        "|---|---|---|---|",
    ]
    if device.get("refused"):
        why = device.get("error") or f"JAX's platform is {device.get('platform')}, not gpu"
        lines[3:3] = [f"REFUSED: {why}; nothing was measured.", ""]
    for record in records:
        lines.append(f"| {record['stage']} | {record['status']} | {record['elapsed_s']:.0f} | {cell(record)} |")
    return lines


def steps_cell(record: dict) -> str:
    """A stage's steps and how each ended, for a summary table's cell."""
    return ", ".join(f"{s['name']} {s['status']}" for s in record["steps"])


def write_summary(out_dir: str, work_dir: str, device: dict, records: list[dict], plan: dict) -> None:
    """Writes summary.json and summary.md, and packs the work directory's stage files into
    stages.tar.gz (a device call returns at most 8 files)."""
    set_headlines(records, lambda record: HEADLINES[record["stage"]](record))
    write_files(out_dir, work_dir, {"device": device, "plan": plan, "stages": records}, markdown(device, records))


def markdown(device: dict, records: list[dict]) -> str:
    def headline(record: dict) -> str:
        return "; ".join(f"{k} {v}" for k, v in record.get("headline", {}).items() if v is not None)

    return "\n".join(markdown_head("GPU run", device, records, "headline", headline)) + "\n"
