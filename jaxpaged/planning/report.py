"""A replay's figures under vLLM's benchmark names: throughput, TTFT/TPOT/ITL/E2EL, concurrency,
and how the steps went (no JAX here).

TPOT is per request (time after the first token over the tokens after it), ITL the gaps between
a stream's deliveries (a fused window's tokens arrive together: one gap), as `jaxpaged bench
serve` computes them; percentiles are numpy's (linear), as there.
"""

import numpy as np

from jaxpaged.planning.replay import ReplayResult

PERCENTILE = 99


def _stats(values: list[float]) -> dict:
    ms = np.asarray(values or [0.0]) * 1000
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), f"p{PERCENTILE}": float(np.percentile(ms, 99))}


def summarize(result: ReplayResult) -> dict:
    """The figures of a replay as a JSON-ready dict (times in ms under `*_ms`)."""
    reqs = [r for r in result.requests if r.deliveries]
    duration = result.duration
    prompt = sum(r.prompt_len for r in reqs)
    output = sum(r.output_len for r in reqs)
    ttft = [r.first_token - r.sent for r in reqs]
    tpot = [(r.finished - r.first_token) / (r.output_len - 1) for r in reqs if r.output_len > 1]
    itl = [b[0] - a[0] for r in reqs for a, b in zip(r.deliveries, r.deliveries[1:])]
    e2el = [r.finished - r.sent for r in reqs]
    programs = {"mixed": 0, "decode": 0, "fused": 0}
    device_steps = padded = real = mixed_padded = mixed_real = 0
    busy = weighted_running = 0.0
    for s in result.steps:
        programs[s.kind] += 1
        device_steps += s.num_steps
        padded += s.tokens * s.num_steps
        real += s.real_tokens * s.num_steps
        if s.kind == "mixed":
            mixed_padded += s.tokens
            mixed_real += s.real_tokens
        busy += s.end - s.start
        weighted_running += s.real_seqs * (s.end - s.start)
    split = {
        "gemm": result.time.gemm,
        "decode_attention": result.time.decode_attention,
        "prefill_attention": result.time.prefill_attention,
        "sampler": result.time.sampler,
        "fixed": result.time.fixed,
    }
    return {
        "duration_s": duration,
        "completed": len(reqs),
        "total_input_tokens": prompt,
        "total_output_tokens": output,
        "request_throughput": len(reqs) / duration if duration else 0.0,
        "output_throughput": output / duration if duration else 0.0,
        "total_token_throughput": (prompt + output) / duration if duration else 0.0,
        "ttft_ms": _stats(ttft),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats(itl),
        "e2el_ms": _stats(e2el),
        "max_concurrency": result.max_running,
        "mean_concurrency": weighted_running / busy if busy else 0.0,
        "num_preemptions": result.num_preemptions,
        "programs": programs,
        "device_steps": device_steps,
        "padding_fraction": 1 - real / padded if padded else 0.0,
        "mixed_padding_fraction": 1 - mixed_real / mixed_padded if mixed_padded else 0.0,
        "device_busy_fraction": busy / duration if duration else 0.0,
        "time_split": {k: v / result.time.total if result.time.total else 0.0 for k, v in split.items()},
    }
