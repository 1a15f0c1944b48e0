"""`jaxpaged bench startup`: what an engine compiles before its first token, program by program.

The engine's whole program set for a model's shapes is lowered from shapes alone (abstract
weights and pool: nothing is materialised, so an 8B preset compiles on a laptop) and compiled
for this machine's backend, as the engine does at start-up:

- the memory probe: the largest mixed step over a small pool, compiled when the pool is sized
  from the device's memory (on a GPU; its temporaries are the activations the plan reserves);
- a mixed step (ragged attention) per token bucket, and a decode step and fused decode steps
  per decode bucket;
- the samplers: each option set (filtering, top logprobs) for each sequence bucket;
- the program that seeds a penalty-table row.

    jaxpaged bench startup --model llama-3.1-8b [--scan-layers] [--output-json startup.json]
    jaxpaged bench startup --target h100    # the programs an H100 runs, compiled here (no GPU needed)

With `--target` the programs are compiled for that GPU from its description (see gpu_targets.py:
the kernels compiled by Triton, the executables an H100 would load), on whatever machine this
is; without autotuning, which needs the device.

The compilation cache is off unless `--compilation-cache-dir DIR` is given: the first run with
an empty DIR measures a cold start, a second run with the same DIR a warm one.
"""

import argparse
import contextlib
import json
import logging
import time

from jaxpaged.bench.gpu_targets import GPU_TARGETS, compiling_for_target, prepare_environment
from jaxpaged.engine_args import EngineArgsError
from jaxpaged.entrypoints.cli_flags import add_engine_flags, engine_args

logger = logging.getLogger("jaxpaged")

# The pool the programs are compiled for when --kv-cache-memory-bytes is not given: what an
# 80 GiB GPU holds beside an 8B model. Compile time does not depend on it.
DEFAULT_POOL_BYTES = 32 * 2**30


def add_startup_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, with the defaults of a start-up measurement (a preset with dummy
    weights, no tokenizer, the compilation cache off)."""
    add_engine_flags(
        parser,
        defaults=dict(
            model="llama-3.1-8b", load_format="dummy", skip_tokenizer_init=True, compilation_cache_dir="none"
        ),
    )
    parser.add_argument("--output-json", metavar="FILE", help="write the per-program and total seconds as JSON")
    parser.add_argument(
        "--target",
        choices=sorted(GPU_TARGETS),
        help="compile for this GPU, on this machine and "
        "without one (deviceless; needs the gpu-compile extra), instead of for this machine's devices",
    )


def run(args: argparse.Namespace) -> int:
    """Compiles every program, printing each as it finishes; writes `--output-json`."""
    engine = engine_args(args)  # every flag is checked before JAX loads
    if args.target and engine.compilation_cache_dir != "none":
        # JAX finds the cached programs (their keys match) but cannot load them without the GPU
        raise EngineArgsError(
            "compilation_cache_dir",
            engine.compilation_cache_dir,
            "a warm start loads the programs onto the GPU, which --target only describes: measure it on the GPU",
        )
    if args.target:
        prepare_environment()
    report = measure_startup(engine, args.target)
    print(format_report(report))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


def measure_startup(args, target: str | None = None) -> dict:
    """Lowers and compiles the engine's programs for `args` (an `EngineArgs`) from shapes alone,
    for this machine's devices or for the GPU `target` (a key of `GPU_TARGETS`).

    Returns:
      A JSON-ready report: the model and limits, each program's lowering and compile seconds,
      their totals and the number of programs.
    """
    from jaxpaged.engine.setup import use_compilation_cache

    cache_dir = use_compilation_cache(args.compilation_cache_dir)
    with contextlib.ExitStack() as stack:
        devices = None
        if target:
            devices = stack.enter_context(
                compiling_for_target(target, args.tensor_parallel_size * args.pipeline_parallel_size)
            )
        return _measure(args, devices, cache_dir)


def _measure(args, devices: list | None, cache_dir: str | None) -> dict:
    import jax

    from jaxpaged.worker.step_programs import Program, compile_all

    began = time.perf_counter()
    worker = abstract_worker(args, devices)
    config, parallel, runner = worker.config, worker.parallel, worker.runner
    setup_seconds = time.perf_counter() - began
    # An engine that sizes its pool from the GPU's memory compiles this probe first.
    probe = Program(max(runner.layouts), 1, False, lora=runner.step_programs.lora)
    began = time.perf_counter()
    small_pool = runner.zero_cache(runner.pages + 1)  # as the engine's probe has it
    results = compile_all(
        [
            (
                "memory probe: " + runner.step_programs.describe(probe),
                lambda: runner.step_programs.lower(probe, runner.params, small_pool),
            )
        ],
        1,
        logger.info,
    )
    runner.warm_up(args.compile_threads)
    results += runner.compile_report
    wall = time.perf_counter() - began
    rows = [{"program": r.name, "lower_s": round(r.lower_s, 3), "compile_s": round(r.compile_s, 3)} for r in results]
    return {
        "model": args.model,
        "dtype": str(runner.params_dtype),
        "num_layers": config.model.num_layers,
        "scan_layers": args.scan_layers,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": config.max_model_len,
        "num_scheduler_steps": args.num_scheduler_steps,
        "num_blocks": config.cache.num_blocks,
        "platform": parallel.platform,
        "jax_version": jax.__version__,
        "device": parallel.mesh.devices.flat[0].device_kind,
        "deviceless": devices is not None,
        "compilation_cache_dir": cache_dir,
        "compile_threads": args.compile_threads,
        "num_programs": len(rows),
        "setup_s": round(setup_seconds, 3),
        "total_lower_s": round(sum(r["lower_s"] for r in rows), 3),
        "total_compile_s": round(sum(r["compile_s"] for r in rows), 3),
        "wall_s": round(wall, 3),
        "programs": rows,
    }


def abstract_worker(args, devices: list | None = None):
    """The engine's own start-up (`prepare_device_worker`) run on shapes: weights and pool as
    `jax.ShapeDtypeStruct`s with the engine's shardings, on `devices` (default: this machine's),
    the pool `kv_cache_memory_bytes` or `DEFAULT_POOL_BYTES`; nothing compiled yet."""
    import dataclasses

    import jax

    from jaxpaged.engine.setup import prepare_device_worker
    from jaxpaged.engine_config import EngineConfig

    args = dataclasses.replace(args, kv_cache_memory_bytes=args.kv_cache_memory_bytes or DEFAULT_POOL_BYTES)
    kind = (devices or jax.devices())[0].device_kind
    memory = next((spec.memory_bytes for spec in GPU_TARGETS.values() if spec.description == kind), None)
    return prepare_device_worker(EngineConfig.resolve(args), devices=devices, abstract=True, device_memory=memory)


def format_report(report: dict) -> str:
    """The report as a table with its totals."""
    lines = [
        f"{r['program']:<58} lower {r['lower_s']:7.2f} s   compile {r['compile_s']:7.2f} s" for r in report["programs"]
    ]
    lines.append(
        f"{report['num_programs']} programs for {report['model']} ({report['num_layers']} layers, "
        f"{'scanned' if report['scan_layers'] else 'unrolled'}, {report['platform']}, jax {report['jax_version']}, "
        f"{report['compile_threads']} compile thread(s)): lowering {report['total_lower_s']:.1f} s, compiling "
        f"{report['total_compile_s']:.1f} s (summed over programs); ready after {report['wall_s']:.1f} s"
    )
    return "\n".join(lines)
