"""A few engine steps under `jax.profiler`, in the middle of a ShareGPT-shaped run: what the
throughput model's GEMM / attention / sampler / fixed split is calibrated from.

    python -m benchmarks.gpu.profile_steps --model llama-3.1-8b --load-format dummy --dtype bfloat16 \\
        --max-model-len 2048 --max-num-seqs 1024 --max-num-batched-tokens 16384 \\
        --compilation-cache-dir DIR --trace-dir TRACE --output-json profile.json

1. `LLM(...)` from the engine flags (its programs from the compilation cache where warm).
2. `--num-requests` requests of random token ids, `--prompt-len` in and `--output-len` out
   (ignore_eos; vLLM's ShareGPT sample averages ~229 / ~189), all queued at once, stepped until
   `--warm-steps` steps have run (the batch full, prompts still arriving into mixed steps).
3. `--traced-steps` steps inside `jax.profiler.trace(TRACE)`, each timed on the host (the engine
   dispatches a step before reading the previous one's tokens, so a step's host time is its
   device time once the pipeline is full), with the scheduled shape of each (tokens, sequences,
   decode-only or mixed). TRACE is packed into TRACE.tar.gz for the trip back (and removed); an XProf or
   TensorBoard profile reader splits its device time by kernel.
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tarfile
import time

from jaxpaged.entrypoints.cli_flags import add_engine_flags, engine_args


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--prompt-len", type=int, default=229)
    parser.add_argument("--output-len", type=int, default=189)
    parser.add_argument("--warm-steps", type=int, default=40)
    parser.add_argument("--traced-steps", type=int, default=8)
    parser.add_argument("--trace-dir", required=True)
    parser.add_argument("--output-json", required=True)
    args = parser.parse_args(argv)
    engine = engine_args(args, skip_tokenizer_init=True)

    import jax
    import numpy as np

    from jaxpaged.entrypoints.llm import LLM
    from jaxpaged.sampling_params import SamplingParams

    llm = LLM(**dataclasses.asdict(engine))
    core = llm.llm_engine
    rng = np.random.default_rng(0)
    vocab = core.config.model.vocab_size
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.num_requests):
        core.add_request(str(i), {"prompt_token_ids": rng.integers(1, vocab, args.prompt_len).tolist()}, params)
    for _ in range(args.warm_steps):
        core.step()
    steps = []
    schedule = core.scheduler.schedule

    def recorded(*a, **k):  # the shape of each traced step, as the scheduler made it
        out = schedule(*a, **k)
        steps[-1].update(
            tokens=sum(len(e.token_ids) for e in out.step_inputs),
            seqs=len(out.step_inputs),
            decode_only=all(len(e.token_ids) == 1 for e in out.step_inputs),
            fused_steps=out.num_steps,
        )
        return out

    core.scheduler.schedule = recorded
    with jax.profiler.trace(args.trace_dir):
        for _ in range(args.traced_steps):
            steps.append({})
            start = time.perf_counter()
            core.step()
            steps[-1]["host_s"] = round(time.perf_counter() - start, 6)
    core.scheduler.schedule = schedule
    with tarfile.open(args.trace_dir.rstrip("/") + ".tar.gz", "w:gz") as tar:
        tar.add(args.trace_dir, arcname=os.path.basename(args.trace_dir.rstrip("/")))
    shutil.rmtree(args.trace_dir)  # the packed copy is what travels
    result = {
        "device": jax.devices()[0].device_kind,
        "engine": {k: v for k, v in dataclasses.asdict(engine).items() if k.startswith("max_")},
        "workload": dict(requests=args.num_requests, prompt_len=args.prompt_len, output_len=args.output_len),
        "warm_steps": args.warm_steps,
        "steps": steps,
        "trace": args.trace_dir.rstrip("/") + ".tar.gz",
        "trace_bytes": os.path.getsize(args.trace_dir.rstrip("/") + ".tar.gz"),
    }
    for s in steps:
        print(f"step: {s}", flush=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
