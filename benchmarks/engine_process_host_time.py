"""The engine's host time per step with output processing on the engine's thread (the engine in
the server's process, `jaxpaged serve --no-engine-process`) and in the server's process while the
engine core steps in a child (`jaxpaged serve`'s default): the same streaming (DELTA) requests of
the demo model through `AsyncEngine`, synchronous steps, a warm-up run, then a measured one:

    python -m benchmarks.engine_process_host_time [--num-seqs 256] [--output-len 64] [--json FILE]

Host time is an engine step's time less its wait for the device (`ModelRunner.fetch`). In the
child it is measured there (its counters ride along in the stats snapshots). A measurement, not a
test: the machine's other load moves it. Results: benchmarks/results/engine_process_host_time_cpu_demo.json.
"""

import argparse
import asyncio
import collections
import json
import time

from benchmarks.call_timing import time_calls
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.engine.core_process import EngineCoreProcess
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine_args import EngineArgs
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.server.async_engine import AsyncEngine
from jaxpaged.worker.model_runner import ModelRunner

STAGES = {  # stage: the methods whose time it is
    "step": ((LLMEngine, "step"), (LLMEngine, "step_deltas")),
    "schedule": ((Scheduler, "schedule"),),
    "execute": ((ModelRunner, "execute"),),
    "fetch": ((ModelRunner, "fetch"),),
    "postprocess": ((Scheduler, "postprocess"),),
    "output_processing": ((OutputProcessor, "process"), (OutputProcessor, "outputs")),
}


def time_stages() -> collections.Counter:
    """Times every stage's methods in this process; returns the counter of seconds (and of steps)."""
    seconds = collections.Counter()
    for stage, methods in STAGES.items():
        for cls, name in methods:
            time_calls(cls, name, lambda s, stage=stage: seconds.update({stage: s}))
    time_calls(LLMEngine, "_step", lambda s: seconds.update({"steps": 1}))
    return seconds


def time_stages_in_core(engine: LLMEngine, start_up_seconds: float) -> None:
    """`on_ready` of the engine-core process: times its stages and sends the counters with its stats."""
    seconds = time_stages()
    stats = engine.get_stats
    engine.get_stats = lambda: {**stats(), "bench_seconds": dict(seconds)}


def run(engine: AsyncEngine, num_seqs: int, params: SamplingParams, tag: str) -> float:
    """Streams `num_seqs` requests to the end; returns the seconds it took."""

    async def go():
        prompts = [{"prompt_token_ids": list(range(10 + i % 7, 42 + i % 7))} for i in range(num_seqs)]
        stream = await engine.add_requests([f"{tag}-{i}" for i in range(num_seqs)], prompts, params)
        async for _ in stream:
            pass

    start = time.perf_counter()
    asyncio.run(go())
    return time.perf_counter() - start


def measure(mode: str, args: EngineArgs, num_seqs: int, params: SamplingParams) -> dict:
    here = time_stages()
    if mode == "engine_thread":
        engine = AsyncEngine(LLMEngine(args))
        core = lambda: here  # noqa: E731
    else:
        engine = AsyncEngine(EngineCoreProcess(args, on_ready=time_stages_in_core))
        core = lambda: collections.Counter(engine.stats["bench_seconds"])  # noqa: E731
    assert engine.ready.wait(600), engine.dead
    run(engine, num_seqs, params, "warm-up")
    before_core, before_here = core().copy(), here.copy()
    total = run(engine, num_seqs, params, "measured")
    core_seconds, here_seconds = core() - before_core, here - before_here
    engine.shutdown()
    steps = core_seconds["steps"]
    per_step = {stage: 1000 * core_seconds[stage] / steps for stage in STAGES}
    return {
        "mode": mode,
        "num_seqs": num_seqs,
        "steps": steps,
        "wall_ms_per_step": 1000 * total / steps,
        "engine_host_ms_per_step": per_step["step"] - per_step["fetch"],
        **{f"engine_{stage}_ms_per_step": ms for stage, ms in per_step.items()},
        "server_output_processing_ms_per_step": 1000 * here_seconds["output_processing"] / steps,
        "output_tokens_per_s": num_seqs * params.max_tokens / total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    engine_args = EngineArgs(
        model=DEMO_MODEL_DIR,
        max_num_seqs=args.num_seqs,
        max_model_len=128,
        num_scheduler_steps=1,
        async_scheduling=False,
    )
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rows = []
    for mode in ("engine_thread", "engine_process"):
        row = measure(mode, engine_args, args.num_seqs, params)
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
