"""Async scheduling against synchronous steps, in the same run on the same engine.

For each model and batch size one engine is built; the same workload (B prompts of 32 tokens,
64 greedy tokens each, EOS ignored) runs with `async_scheduling` off, on, off, on, and the
better of each mode's two runs is kept. Per mode: output tokens/s, engine steps, milliseconds
per step, and of those the host's (everything but waiting for a step's results) and the wait.
With steps overlapped, host work the device's time covers is hidden: `hidden_ms` is the wait
that async scheduling removed per step (sync wait - async wait), at most the host's time.

    python -m benchmarks.async_scheduling [--batches 1 16 64 256] [--steps 1 4] [--output FILE]

Models: the shipped demo model (4 layers, d 256) and a wider one with random weights (`wide`:
4 layers, d 768, vocab 16,000: 53M parameters against the demo's 6M).
Results: benchmarks/results/async_scheduling_cpu.json.
"""

import argparse
import json
import os
import tempfile
import time

from benchmarks.call_timing import time_calls
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
from jaxpaged.sampling_params import SamplingParams

PROMPT_LEN, OUTPUT_LEN = 32, 64
WIDE = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "num_hidden_layers": 4,
    "vocab_size": 16000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "torch_dtype": "float32",
}


def timed_fetch(engine: LLMEngine) -> list[float]:
    """Times the runner's `fetch`: the list of the seconds each call waits for a step's results."""
    waits = []
    time_calls(engine.runner, "fetch", waits.append)
    return waits


def run_once(engine: LLMEngine, batch: int, async_scheduling: bool, waits: list[float]) -> dict:
    engine.runner.async_scheduling = async_scheduling
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for i in range(batch):
        prompt = [(7 * i + j) % 500 + 3 for j in range(PROMPT_LEN)]
        engine.add_request(f"{async_scheduling}-{time.perf_counter()}-{i}", {"prompt_token_ids": prompt}, params)
    waits.clear()
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    wait_ms = 1000 * sum(waits) / steps
    ms = 1000 * seconds / steps
    return {
        "tokens_per_s": round(batch * OUTPUT_LEN / seconds, 1),
        "steps": steps,
        "ms_per_step": round(ms, 3),
        "host_ms_per_step": round(ms - wait_ms, 3),
        "wait_ms_per_step": round(wait_ms, 3),
    }


def measure(model: str, name: str, batch: int, num_steps: int, dummy: bool) -> dict:
    engine = LLMEngine(
        EngineArgs(
            model=model,
            load_format="dummy" if dummy else "auto",
            skip_tokenizer_init=True,
            max_model_len=PROMPT_LEN + OUTPUT_LEN,
            max_num_seqs=batch,
            max_num_batched_tokens=max(256, batch),
            num_scheduler_steps=num_steps,
            compilation_cache_dir="none",
        )
    )
    waits = timed_fetch(engine)
    run_once(engine, min(batch, 4), True, waits)  # warm-up
    runs = {False: [], True: []}
    for mode in (False, True, False, True):
        runs[mode].append(run_once(engine, batch, mode, waits))
    best = {mode: max(r, key=lambda x: x["tokens_per_s"]) for mode, r in runs.items()}
    sync, asyn = best[False], best[True]
    hidden = min(asyn["host_ms_per_step"], max(0.0, sync["wait_ms_per_step"] - asyn["wait_ms_per_step"]))
    row = {
        "model": name,
        "batch": batch,
        "num_scheduler_steps": num_steps,
        "sync": sync,
        "async": asyn,
        "speedup": round(asyn["tokens_per_s"] / sync["tokens_per_s"], 3),
        "hidden_ms_per_step": round(hidden, 3),
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 4], help="num_scheduler_steps values")
    parser.add_argument("--models", nargs="+", default=["demo", "wide"], choices=["demo", "wide"])
    parser.add_argument("--output", help="write the rows as JSON")
    args = parser.parse_args()
    wide_dir = tempfile.mkdtemp()
    with open(os.path.join(wide_dir, "config.json"), "w") as f:
        json.dump(WIDE, f)
    rows = []
    for name in args.models:
        model, dummy = (DEMO_MODEL_DIR, False) if name == "demo" else (wide_dir, True)
        for batch in args.batches:
            for num_steps in args.steps:
                rows.append(measure(model, name, batch, num_steps, dummy))
                if args.output:  # after every row: a slow one never costs the others
                    with open(args.output, "w") as f:
                        json.dump(rows, f, indent=1)
                        f.write("\n")


if __name__ == "__main__":
    main()
