"""What the 4-bit checkpoint formats cost in accuracy on the demo model, measured on CPU.

The demo model (bfloat16) is quantized by the tests' independent packers (tests/int4_checkpoints.py:
min/max scales in groups of input features, without AWQ's activation-aware scaling or GPTQ's error
feedback, so these rows measure the formats' grids, not those algorithms), saved as an AWQ, a GPTQ
and a compressed-tensors checkpoint, and loaded by jaxpaged like any downloaded checkpoint. Each is
scored on the held-out King James text (`jaxpaged.bench.perplexity`): perplexity, and top-1
agreement (the share of positions whose argmax equals the bfloat16 model's). `--quantization int4`
(round to nearest at load, the same group size) is listed beside them.

    python -m benchmarks.int4_formats_accuracy --json benchmarks/results/int4_formats_accuracy_cpu.json
"""

import argparse
import os
import platform
import sys
import tempfile
import time

import jax
import numpy as np
import transformers

from benchmarks.quantization_accuracy import DEMO_MODEL
from benchmarks.results_files import save_results
from jaxpaged.bench.perplexity import heldout_token_windows, negative_log_likelihoods
from jaxpaged.checkpoint.loader import load_model
from jaxpaged.worker.paged_generate import PagedGenerator

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from int4_checkpoints import write_int4_checkpoint  # noqa: E402  (the tests' packers)

# The demo model's MLP width, 704, is 11 * 64: groups of 64 divide every projection's inputs.
GROUP_SIZE = 64
# row name -> packer kind (tests/int4_checkpoints.py)
KINDS = {
    "AWQ (asymmetric, g64)": "awq",
    "GPTQ (symmetric, g64)": "gptq_sym",
    "compressed-tensors W4A16 (symmetric, g64)": "compressed_group",
}


def score(model, windows: list[list[int]], reference: list[np.ndarray] | None) -> tuple[float, float, list]:
    """`(perplexity, top-1 agreement with `reference`'s argmax, argmax per window)`."""
    generator = PagedGenerator(model)
    nll, argmax = [], []
    for w in windows:
        logits = generator.prompt_logits(w)
        nll.append(negative_log_likelihoods(logits, w))
        argmax.append(logits.argmax(-1))
    agree = 1.0 if reference is None else float(np.mean(np.concatenate(argmax) == np.concatenate(reference)))
    return float(np.exp(np.concatenate(nll).mean())), agree, argmax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--max-windows", type=int, default=None, help="at most this many windows (default: all)")
    parser.add_argument("--json", default=None, help="write the report here (and a .md table beside it)")
    args = parser.parse_args()
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL)
    windows = heldout_token_windows(tokenizer, args.window, args.max_windows)
    _, model = load_model(DEMO_MODEL, "bfloat16")
    base_ppl, _, reference = score(model, windows, None)
    rows = [dict(mode="bfloat16", perplexity=base_ppl, vs_baseline=0.0, top1_agreement=1.0)]
    _, model = load_model(DEMO_MODEL, "bfloat16", quantization="int4", quantization_group_size=GROUP_SIZE)
    ppl, agree, _ = score(model, windows, reference)
    rows.append(
        dict(
            mode="--quantization int4 (round to nearest at load, g64)",
            perplexity=ppl,
            vs_baseline=ppl / base_ppl - 1,
            top1_agreement=agree,
        )
    )
    for mode, kind in KINDS.items():
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as workdir:
            hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL)
            write_int4_checkpoint(hf, kind, workdir, group_size=GROUP_SIZE)
            _, model = load_model(workdir, "bfloat16")
        ppl, agree, _ = score(model, windows, reference)
        rows.append(dict(mode=mode, perplexity=ppl, vs_baseline=ppl / base_ppl - 1, top1_agreement=agree))
        print(
            f"{mode:44s} perplexity {ppl:.4f} ({ppl / base_ppl - 1:+.2%}) top-1 {agree:.2%} "
            f"in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
    table = ["| demo model (bfloat16) | held-out perplexity | vs bfloat16 | top-1 agreement |", "|---|---|---|---|"]
    table += [
        f"| {r['mode']} | {r['perplexity']:.3f} | {r['vs_baseline']:+.2%} | {r['top1_agreement']:.1%} |" for r in rows
    ]
    report = dict(
        device=platform.processor() or platform.machine(),
        jax_version=jax.__version__,
        window=args.window,
        tokens=len(windows) * (args.window - 1),
        group_size=GROUP_SIZE,
        rows=rows,
    )
    print("\n".join(table))
    if args.json:
        save_results(args.json, report, "\n".join(table))


if __name__ == "__main__":
    main()
