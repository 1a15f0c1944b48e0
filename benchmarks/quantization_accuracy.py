"""What each quantization mode costs in accuracy, measured (CPU is enough: the numerics are the
same as on a GPU, where an fp8 pool is stored in float8 instead of float8 values in float32).

1. Tiny random models against transformers in float32: max / mean absolute logit error over
   every position of a fixed prompt set, argmax agreement there, and greedy agreement (the
   share of 32 greedy tokens generated before the first difference from transformers'). Random
   models have near-tied logits, so greedy paths part early even for the unquantized model in
   bfloat16, which is listed as the yardstick.
2. The demo model (bfloat16) on held-out King James text: perplexity of each mode against
   bfloat16 (`jaxpaged.bench.perplexity`).

    python -m benchmarks.quantization_accuracy --json benchmarks/results/quantization_accuracy_cpu.json
    python -m benchmarks.quantization_accuracy --modes "other dtype,int4 weights (RTN),int4 weights (RTN) + fp8 KV" \
        --json benchmarks/results/quantization_accuracy_int4_cpu.json
"""

import argparse
import os
import platform
import tempfile
import time

import jax
import numpy as np
import torch
import transformers

from benchmarks.results_files import save_results
from jaxpaged.bench.perplexity import heldout_token_windows, perplexity
from jaxpaged.checkpoint.loader import load_model
from jaxpaged.worker.paged_generate import PagedGenerator

DEMO_MODEL = os.path.join(os.path.dirname(__file__), "..", "jaxpaged", "demo_model")
# name -> (weight quantization, KV cache dtype); "other dtype" is the unquantized model in the
# other float dtype (bfloat16 for the float32 tiny models, float32 for the bfloat16 demo model):
# the yardstick a quantization error compares with.
MODES = {
    "baseline": (None, None),
    "other dtype": (None, None),
    "fp8 KV (e4m3)": (None, "float8_e4m3fn"),
    "fp8 KV (e5m2)": (None, "float8_e5m2"),
    "fp8 weights": ("fp8", None),
    "int8 weights": ("int8", None),
    "fp8 weights + fp8 KV": ("fp8", "float8_e4m3fn"),
    "int8 weights + fp8 KV": ("int8", "float8_e4m3fn"),
    "int4 weights (RTN)": ("int4", None),
    "int4 weights (RTN) + fp8 KV": ("int4", "float8_e4m3fn"),
    # AWQ, GPTQ and compressed-tensors checkpoints of the demo model: the removed one-off study
    # benchmarks/int4_formats_accuracy.py (git log -- benchmarks/int4_formats_accuracy.py)
}
# Input features per group of the int4 modes: the demo model's MLP width (704 = 11 x 64) refuses 128.
INT4_GROUP_SIZE = 64
# Tiny HF models: (config class, model class, config overrides).
TINY = {
    "llama-gqa": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2-bias": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
}
TINY_BASE = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
PROMPT_LENGTHS = (5, 17, 64, 200)
GREEDY_TOKENS = 32


def save_tiny(name: str, path: str):
    """A float32 tiny model with wider-than-default weights (real argmax margins), saved to `path`."""
    config_cls, model_cls, overrides = TINY[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY_BASE, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08 if p.ndim > 1 else 0.3).add_(1.0 if p.ndim == 1 and p.shape[0] == 128 else 0.0)
    model.save_pretrained(path, safe_serialization=True)
    return model


def tiny_model_rows(name: str, workdir: str, modes: list[str]) -> list[dict]:
    """Logit and greedy agreement of every mode with transformers on one tiny model."""
    hf = save_tiny(name, workdir)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, TINY_BASE["vocab_size"], n).tolist() for n in PROMPT_LENGTHS]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref_logits = [hf(torch.tensor([p])).logits[0].numpy() for p in prompts]
        ref_greedy = [
            hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=GREEDY_TOKENS, pad_token_id=0)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    rows = []
    for mode in modes:
        quantization, kv_dtype = MODES[mode]
        dtype = "bfloat16" if mode == "other dtype" else "float32"
        _, model = load_model(workdir, dtype, quantization=quantization, quantization_group_size=INT4_GROUP_SIZE)
        generator = PagedGenerator(model, kv_dtype=kv_dtype)
        errors = [np.abs(generator.prompt_logits(p) - r) for p, r in zip(prompts, ref_logits)]
        argmax = [(generator.prompt_logits(p).argmax(-1) == r.argmax(-1)).mean() for p, r in zip(prompts, ref_logits)]
        greedy = generator.generate(prompts, GREEDY_TOKENS)
        agree = [
            next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), GREEDY_TOKENS) / GREEDY_TOKENS
            for g, r in zip(greedy, ref_greedy)
        ]
        rows.append(
            dict(
                model=name,
                mode=mode,
                max_abs_logit_error=float(max(e.max() for e in errors)),
                mean_abs_logit_error=float(np.mean([e.mean() for e in errors])),
                logit_scale=float(np.mean([r.std() for r in ref_logits])),
                argmax_agreement=float(np.mean(argmax)),
                greedy_agreement=float(np.mean(agree)),
            )
        )
        print(
            f"{name:11s} {mode:24s} max {rows[-1]['max_abs_logit_error']:.4f} mean "
            f"{rows[-1]['mean_abs_logit_error']:.5f} argmax {rows[-1]['argmax_agreement']:.3f} greedy "
            f"{rows[-1]['greedy_agreement']:.3f}",
            flush=True,
        )
    return rows


def demo_perplexity_rows(window: int, max_windows: int | None, modes: list[str]) -> list[dict]:
    """Held-out perplexity of the bfloat16 demo model in every mode."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL)
    windows = heldout_token_windows(tokenizer, window, max_windows)
    rows, base = [], None
    for mode in modes:
        quantization, kv_dtype = MODES[mode]
        start = time.perf_counter()
        dtype = "float32" if mode == "other dtype" else "bfloat16"
        _, model = load_model(DEMO_MODEL, dtype, quantization=quantization, quantization_group_size=INT4_GROUP_SIZE)
        ppl = perplexity(PagedGenerator(model, kv_dtype=kv_dtype), windows)
        base = base or ppl
        rows.append(dict(mode=mode, perplexity=ppl, vs_baseline=ppl / base - 1, tokens=len(windows) * (window - 1)))
        print(
            f"demo {mode:24s} perplexity {ppl:.4f} ({ppl / base - 1:+.2%}) in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
    return rows


def markdown(report: dict) -> str:
    lines = [
        "| tiny model (float32; logit std) | mode | max abs logit error | mean abs logit error | argmax agreement "
        "| greedy agreement |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["tiny_models"]:
        mode = "bfloat16" if r["mode"] == "other dtype" else r["mode"]
        lines.append(
            f"| {r['model']} ({r['logit_scale']:.2f}) | {mode} | {r['max_abs_logit_error']:.4f} | "
            f"{r['mean_abs_logit_error']:.5f} | {r['argmax_agreement']:.1%} | {r['greedy_agreement']:.1%} |"
        )
    lines += ["", "| demo model (bfloat16) | held-out perplexity | vs bfloat16 |", "|---|---|---|"]
    for r in report["demo_perplexity"]:
        mode = "float32" if r["mode"] == "other dtype" else r["mode"]
        lines.append(f"| {mode} | {r['perplexity']:.3f} | {r['vs_baseline']:+.2%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--max-windows", type=int, default=None, help="at most this many windows (default: all)")
    parser.add_argument("--json", default=None, help="write the report here (and a .md table beside it)")
    parser.add_argument(
        "--modes", default=None, help="comma-separated modes to measure after the baseline (default: every mode)"
    )
    args = parser.parse_args()
    modes = list(MODES) if args.modes is None else ["baseline", *args.modes.split(",")]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes {args.modes!r}: unknown {unknown}; modes are {list(MODES)}")
    report = dict(
        device=platform.processor() or platform.machine(),
        jax_version=jax.__version__,
        tiny_models=[],
        greedy_tokens=GREEDY_TOKENS,
        prompt_lengths=list(PROMPT_LENGTHS),
        window=args.window,
        int4_group_size=INT4_GROUP_SIZE,
    )
    for name in TINY:
        with tempfile.TemporaryDirectory() as workdir:
            report["tiny_models"] += tiny_model_rows(name, workdir, modes)
    report["demo_perplexity"] = demo_perplexity_rows(args.window, args.max_windows, modes)
    table = markdown(report)
    print(table)
    if args.json:
        save_results(args.json, report, table)


if __name__ == "__main__":
    main()
