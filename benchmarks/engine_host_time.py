"""Where the engine thread's host time goes in a real engine step, by stage: schedule, execute
(pack and dispatch), fetch (waiting for the device, then unpacking), the scheduler's postprocess,
and output processing (logprobs, detokenization, stop strings, then one `RequestOutput` per
changed request). Streaming requests (DELTA, what the server asks for) and FINAL_ONLY ones (what
`LLM.generate` asks for) in turn, synchronous steps, the demo model:

    python -m benchmarks.engine_host_time [--num-seqs 256] [--output-len 64] [--json FILE]

Results: benchmarks/results/engine_host_time_cpu_demo.json.
"""

import argparse
import collections
import json
import time

from benchmarks.call_timing import time_calls
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine_args import EngineArgs
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.worker.model_runner import ModelRunner

STAGES = {  # stage: the method whose time it is
    "schedule": (Scheduler, "schedule"),
    "execute": (ModelRunner, "execute"),
    "fetch": (ModelRunner, "fetch"),
    "postprocess": (Scheduler, "postprocess"),
    "output_tokens": (OutputProcessor, "process"),
    "request_outputs": (OutputProcessor, "outputs"),
}


def time_stages() -> collections.Counter:
    """Times every stage's method; returns the counter of each stage's seconds."""
    seconds = collections.Counter()
    for stage, (cls, name) in STAGES.items():
        time_calls(cls, name, lambda s, stage=stage: seconds.update({stage: s}))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    seconds = time_stages()
    rows = []
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        engine = LLMEngine(
            EngineArgs(
                model=DEMO_MODEL_DIR,
                max_num_seqs=args.num_seqs,
                max_model_len=128,
                num_scheduler_steps=1,
                async_scheduling=False,
            )
        )
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, output_kind=kind)
        for run in range(2):  # the first compiles nothing (start-up did) but warms the host's caches
            seconds.clear()
            for i in range(args.num_seqs):
                engine.add_request(f"{run}-{i}", {"prompt_token_ids": list(range(10 + i % 7, 42 + i % 7))}, params)
            start, steps = time.perf_counter(), 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            total = time.perf_counter() - start
        host = total - seconds["fetch"]
        row = {
            "output_kind": kind.name,
            "num_seqs": args.num_seqs,
            "steps": steps,
            "ms_per_step": 1000 * total / steps,
            "host_ms_per_step": 1000 * host / steps,
            **{f"{stage}_ms_per_step": 1000 * seconds[stage] / steps for stage in STAGES},
            "output_processing_share_of_host": (seconds["output_tokens"] + seconds["request_outputs"]) / host,
        }
        rows.append(row)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        del engine
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
