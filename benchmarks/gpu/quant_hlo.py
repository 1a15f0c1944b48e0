"""The compiled HLO of the engine's step programs under a weight quantization: do the projections
run as fp8 (or int8) GEMMs, or are the weights converted, re-laid out or copied first?

    python -m benchmarks.gpu.quant_hlo --model llama-3.1-8b --quantization fp8 --kv-cache-dtype fp8 \\
        --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 2048 \\
        --programs decode:16,mixed:2048 --label fp8 --hlo-dir DIR --output-json hlo_fp8.json

The programs are built from shapes alone (as `jaxpaged bench startup` does: abstract weights and
pool, nothing materialised), compiled for this machine's backend, and their optimised HLO text
(`Compiled.as_text()`) is written to DIR and read by `hlo_census.census`, with the element counts
of the decoder's projection weights (one layer's and the stacked array's) as "weight-sized".
`decode:N` is the decode program of the N-sequence bucket (batch-1 decode runs in the smallest),
`fused:N` its program of fused decode steps (`--num-scheduler-steps`), `mixed:N` the mixed
(prefill) program of the N-token bucket. Each program's temporaries (`temp_bytes`, from XLA's
memory analysis) are recorded beside the counts. The programs compile in parallel;
the JSON is rewritten as each is counted. `--target h100` compiles them for an H100 on any
machine (deviceless, see jaxpaged/bench/gpu_targets.py: no autotuning).
"""

import argparse
import concurrent.futures
import json
import os
import sys
import time

STARTED = time.perf_counter()

from benchmarks.gpu.hlo_census import census  # noqa: E402
from jaxpaged.bench.gpu_targets import compiling_for_target, prepare_environment  # noqa: E402
from jaxpaged.bench.startup import abstract_worker, add_startup_flags  # noqa: E402
from jaxpaged.entrypoints.cli_flags import engine_args  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def weight_sizes(params, scan_layers: bool) -> dict[str, list[int]]:
    """Element counts of each projection weight: one layer's and, when stacked, all layers'."""
    import jax

    sizes: dict[str, set[int]] = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        weight = next((n for n in names if n.removesuffix("_quant") in PROJECTIONS and not n.endswith("_scale")), None)
        if weight is None:
            continue
        size = 1
        for d in leaf.shape:
            size *= d
        found = sizes.setdefault(weight.removesuffix("_quant"), set())
        found.add(size)
        if scan_layers and "layers" in names and len(leaf.shape) >= 3:
            found.add(size // leaf.shape[0])
    return {name: sorted(found) for name, found in sorted(sizes.items())}


def pick(programs, spec: str):
    """The program a `decode:N` / `fused:N` / `mixed:N` spec names: the bucket of N, else the
    nearest larger, else the largest."""
    kind, _, count = spec.partition(":")
    if kind not in ("decode", "fused", "mixed") or not count.isdigit():
        raise ValueError(f"--programs {spec!r}: decode:N, fused:N or mixed:N")
    candidates = sorted(
        (p for p in programs.all() if p.decode == (kind != "mixed") and (p.steps > 1) == (kind == "fused")),
        key=lambda p: p.tokens,
    )
    if not candidates:
        raise ValueError(f"--programs {spec!r}: no such program (fused steps need --num-scheduler-steps > 1)")
    wanted = int(count)
    return next((p for p in candidates if p.tokens >= wanted), candidates[-1])


def save(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def report(label: str, spec: str, description: str, compile_s: float, temp_bytes: int, found: dict) -> None:
    sized = found["weight_sized"]
    print(
        f"{label} {spec} ({description}) compiled in {compile_s:.1f} s, temporaries {temp_bytes / 2**20:.1f} MiB: "
        f"custom calls {found['custom_calls']}; "
        f"GEMM fusions {found['gemm_fusions']}; fp8 GEMM custom calls {found['fp8_gemm_custom_calls']}; "
        f"weight-sized: upcasts {sized['upcasts']}, 8-bit relayouts {sized['relayouts_8bit']}, "
        f"slice copies {sized['slice_copies']}",
        flush=True,
    )
    for title, counts in (
        ("gemm", found["gemms"]),
        ("dot", found["dots"]),
        ("weight-sized buffer", sized["materialized"]),
        ("weight-sized, read in place", sized["inside_fusions"]),
    ):
        for signature, count in counts.items():
            print(f"  {title} x{count}: {signature}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_startup_flags(parser)  # --output-json included
    parser.add_argument("--programs", default="decode:16,mixed:2048", help="comma-separated decode:N / mixed:N")
    parser.add_argument("--label", default=None, help="names the HLO files (default: the quantization)")
    parser.add_argument("--hlo-dir", default=".", help="where the HLO text files go")
    args = parser.parse_args(argv)
    engine = engine_args(args)
    if not args.target:
        return census_programs(args, engine)
    prepare_environment()
    with compiling_for_target(args.target, engine.tensor_parallel_size) as devices:
        return census_programs(args, engine, devices)


def census_programs(args, engine, devices: list | None = None) -> int:
    """Compiles the chosen programs (for `devices`, or this machine's) and counts their HLO."""
    import jax

    label = args.label or engine.quantization or "bf16"
    worker = abstract_worker(engine, devices)
    config, parallel, params = worker.config, worker.parallel, worker.runner.params
    programs, pool = worker.runner.step_programs, worker.runner.cache
    device = parallel.mesh.devices.flat[0]
    print(
        f"imports {time.perf_counter() - STARTED:.1f} s; jax {jax.__version__} on {device.device_kind}"
        f"{' (deviceless)' if devices else ''}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    sizes = weight_sizes(params, engine.scan_layers)
    all_sizes = {s for found in sizes.values() for s in found}
    print(
        f"{label}: weight dtypes {sorted({str(x.dtype) for x in jax.tree.leaves(params)})}; projection sizes {sizes}",
        flush=True,
    )
    chosen = {spec: pick(programs, spec) for spec in args.programs.split(",")}
    result = {
        "label": label,
        "model": engine.model,
        "quantization": engine.quantization,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "scan_layers": engine.scan_layers,
        "device": device.device_kind,
        "platform": parallel.platform,
        "deviceless": devices is not None,
        "jax_version": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "num_blocks": config.cache.num_blocks,
        "weight_dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(params)}),
        "weight_sizes": sizes,
        "programs": {},
        "complete": False,
    }
    os.makedirs(args.hlo_dir, exist_ok=True)
    save(result, args.output_json)
    lowered = {}
    for spec, program in chosen.items():  # tracing holds Python's lock: one after another
        start = time.perf_counter()
        lowered[spec] = (programs.lower(program, params, pool), time.perf_counter() - start)

    def compile_one(spec: str):
        start = time.perf_counter()
        return spec, lowered[spec][0].compile(), time.perf_counter() - start

    # XLA compiles without the lock: all at once, each counted and saved as it finishes (a step
    # cut off by its timeout keeps the programs done)
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(chosen)) as executor:
        for future in concurrent.futures.as_completed([executor.submit(compile_one, spec) for spec in chosen]):
            spec, executable, compile_s = future.result()
            text = executable.as_text()
            temp_bytes = executable.memory_analysis().temp_size_in_bytes
            path = os.path.join(args.hlo_dir, f"hlo_{label}_{spec.replace(':', '')}.txt")
            with open(path, "w") as f:
                f.write(text)
            found = census(text, all_sizes)
            result["programs"][spec] = {
                "program": programs.describe(chosen[spec]),
                "lower_s": round(lowered[spec][1], 2),
                "compile_s": round(compile_s, 2),
                "hlo_file": os.path.basename(path),
                "hlo_chars": len(text),
                "temp_bytes": temp_bytes,
                **found,
            }
            save(result, args.output_json)
            report(label, spec, programs.describe(chosen[spec]), compile_s, temp_bytes, found)
    result["complete"] = True
    result["total_s"] = round(time.perf_counter() - STARTED, 1)
    save(result, args.output_json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
