"""Host overhead per engine step: schedule + input packing + postprocess + detokenization.

With 256 sequences in decode (the steady state of a busy server), times the host-side work
the engine does around every step, without device work, and compares it with the budget
(1 ms; an 8B model's decode step on an H100 is ~5 ms, so the host must stay far below it).
"schedule + pack" is paid once per device program, so fused decode steps
(num_scheduler_steps=K) divide it by K; postprocess and detokenization are paid per token.

    python -m benchmarks.host_overhead [--num-seqs 256] [--steps 200] [--json out.json]
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from jaxpaged.core.detokenizer import IncrementalDetokenizer
from jaxpaged.core.scheduler import Scheduler, SchedulerConfig
from jaxpaged.core.sequence import Sequence
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.step_packer import SequenceRow, StepPacker, sampling_row

BUDGET_MS = 1.0


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args(argv)

    block_size, max_model_len = 16, 2048
    num_blocks = args.num_seqs * (max_model_len // block_size) + 1
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=args.num_seqs,
            max_num_batched_tokens=args.num_seqs * args.prompt_len,
            max_model_len=max_model_len,
            block_size=block_size,
            num_blocks=num_blocks,
        )
    )
    # The engine's packer for a 256-sequence server (decode steps use the 256-token bucket).
    packer = StepPacker(
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=args.num_seqs,
        max_num_batched_tokens=2048,
        vocab_size=128256,
    )

    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_model_len - args.prompt_len, seed=1)
    from transformers import AutoTokenizer  # after the arguments are checked

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    detokenizers = {}
    rows = {}
    for i in range(args.num_seqs):
        seq = Sequence(str(i), rng.integers(0, 1024, args.prompt_len).tolist(), params)
        scheduler.add(seq)
        rows[seq.seq_id] = SequenceRow(seq.seq_id, sampling_row(params, 0), i, args.prompt_len)
        detokenizers[seq.seq_id] = IncrementalDetokenizer(tokenizer, seq.prompt_token_ids[-8:], stop=["\n\n"])
    # Prefill everything (one big step), then time decode steps.
    out = scheduler.schedule()
    scheduler.postprocess(out, [1] * out.num_seqs)
    timings = {"schedule": [], "pack": [], "postprocess": [], "detokenize": [], "total": []}
    vocab = len(tokenizer)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        out = scheduler.schedule()
        t1 = time.perf_counter()
        packer.pack(out.step_inputs, [rows[s.seq_id] for s, _ in out.scheduled], [])
        t2 = time.perf_counter()
        scheduler.postprocess(out, rng.integers(3, vocab, out.num_seqs).tolist())
        t3 = time.perf_counter()
        for seq, _ in out.scheduled:
            detok = detokenizers[seq.seq_id]
            detok.add_token(seq.output_token_ids[-1])
            detok.take_delta(False)
        t4 = time.perf_counter()
        for name, value in (
            ("schedule", t1 - t0),
            ("pack", t2 - t1),
            ("postprocess", t3 - t2),
            ("detokenize", t4 - t3),
            ("total", t4 - t0),
        ):
            timings[name].append(value * 1e3)
        assert out.num_seqs == args.num_seqs
    result = {name: statistics.median(v) for name, v in timings.items()}
    result.update(
        num_seqs=args.num_seqs, budget_ms=BUDGET_MS, ratio_to_budget=result["total"] / BUDGET_MS, cpu=os.cpu_count()
    )
    print(f"host work per decode step with {args.num_seqs} running sequences (median of {args.steps}):")
    for name in ("schedule", "pack", "postprocess", "detokenize", "total"):
        print(f"  {name:12s} {result[name]:7.3f} ms")
    print(f"  total / budget ({BUDGET_MS} ms) = {result['ratio_to_budget']:.2f}x")
    per_token_fused = (result["schedule"] + result["pack"]) / 4 + result["postprocess"] + result["detokenize"]
    result["per_token_with_4_fused_steps"] = per_token_fused
    print(f"  per decode token with num_scheduler_steps=4: {per_token_fused:.3f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
