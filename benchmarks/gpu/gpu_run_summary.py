"""The summary of `benchmarks/gpu_run.py`: each stage's headline numbers, and summary.md's one
table of every stage's status and headline (files and plumbing: `gpu/summary.py`)."""

from benchmarks.gpu.summary import Summary, markdown_head, rounded, step_result


def kernels_headline(record: dict) -> dict:
    result = step_result(record, "kernels") or {}
    errs = [c["rel_err"] for c in result.get("checks", []) if c.get("rel_err") is not None]
    decode = [r for r in result.get("decode", []) if r.get("frac_of_measured_hbm") is not None]
    best = max(decode, key=lambda r: r["frac_of_measured_hbm"], default=None)
    prefill = [r for r in result.get("prefill", []) if r.get("ours_TFLOPs") is not None]
    longest = max(prefill, key=lambda r: r["tokens"], default=None)
    kv = (step_result(record, "kv_transfer") or {}).get("GB_per_s", {})
    return {
        "kv_offload_GBps": rounded(kv.get("offload"), 1),
        "kv_load_GBps": rounded(kv.get("load"), 1),
        "device_get_GBps": rounded(kv.get("device_get"), 1),
        "device_put_GBps": rounded(kv.get("device_put"), 1),
        "hbm_copy_GBps": rounded(result["hbm_copy_Bps"] / 1e9, 0) if result.get("hbm_copy_Bps") else None,
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
    cold, warm = step_result(record, "cold") or {}, step_result(record, "warm") or {}
    return {"programs": cold.get("num_programs"), "cold_s": cold.get("wall_s"), "warm_s": warm.get("wall_s")}


def engine_start_headline(record: dict) -> dict:
    cold, warm = step_result(record, "cold") or {}, step_result(record, "warm") or {}
    return {
        "cold_ready_s": cold.get("ready_s"),
        "warm_ready_s": warm.get("ready_s"),
        "cold_first_generate_s": cold.get("first_generate_s"),
    }


def latency_headline(record: dict) -> dict:
    result = step_result(record, "batch1") or {}
    tpot = {
        name: rounded((step_result(record, f"batch1_{name}") or {}).get("avg_time_per_output_token_ms"))
        for name in ("sync", "one_step", "scanned", "scanned_cublas_in_place")
    }
    return {
        "tpot_ms": rounded(result.get("avg_time_per_output_token_ms")),
        "avg_latency_s": rounded(result.get("avg_latency"), 3),
        **{f"tpot_ms_{name}": value for name, value in tpot.items()},
    }


def throughput_headline(record: dict) -> dict:
    result = step_result(record, "vs_transformers", "jaxpaged_only") or {}
    theirs = result.get("transformers") or {}
    return {
        "requests": result.get("num_requests"),
        "output_tok_s": rounded(result.get("output_tokens_per_second"), 0),
        "requests_s": rounded(result.get("requests_per_second")),
        "transformers_output_tok_s": rounded(theirs.get("output_tokens_per_second"), 0),
        "vs_transformers": rounded(result.get("output_throughput_vs_transformers")),
    }


def serve_headline(record: dict) -> dict:
    result = step_result(record, "three_rates") or {}
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


def markdown(device: dict, records: list[dict], plan: dict) -> str:
    def headline(record: dict) -> str:
        return "; ".join(f"{k} {v}" for k, v in record.get("headline", {}).items() if v is not None)

    return "\n".join(markdown_head("GPU run", device, records, "headline", headline)) + "\n"


SUMMARY = Summary(lambda record, records: HEADLINES[record["stage"]](record), markdown)
