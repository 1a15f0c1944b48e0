"""Speculative decoding against plain decoding, in the same run: output tokens/s and acceptance.

Held-out King James verses (`jaxpaged.bench.perplexity`'s text: real repetition for the n-gram
lookup to find) are continued at batch 1, 8 and 64, greedy and sampled, 128 tokens each. Each
configuration is one engine (one compile), measured after a warm-up batch; the speculative
engines report vLLM's counters (proposed and accepted tokens).

- `--part ngram`: the demo model, plain and with n-gram proposals.
- `--part draft`: a larger target built from the demo model (its 4 layers, then 4 more copies of
  them whose output projections are scaled by 0.2: twice the layers, a distribution near the
  demo model's but not equal), plain and with the demo model as its draft.

    python -m benchmarks.speculative_decoding --part ngram --json benchmarks/results/speculative_cpu_demo.json
    python -m benchmarks.speculative_decoding --part draft --json benchmarks/results/speculative_cpu_draft.json

By default the engine's `SpeculationGovernor` decides when a step speculates; `--every-step`
speculates whenever a sequence has proposals (what speculation itself costs and gains).
"""

import argparse
import json
import os
import platform
import tempfile
import time

import jax
import transformers

from benchmarks.results_files import save_results
from jaxpaged import LLM, SamplingParams
from jaxpaged.bench.perplexity import HELDOUT_FILE

DEMO_MODEL = os.path.join(os.path.dirname(__file__), "..", "jaxpaged", "demo_model")
CONFIGS = {
    "ngram": {
        "plain": None,
        "ngram k=2": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
        "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1},
    },
    "draft": {
        "plain": None,
        "draft k=2": {"model": DEMO_MODEL, "num_speculative_tokens": 2},
        "draft k=4": {"model": DEMO_MODEL, "num_speculative_tokens": 4},
    },
}
EXTRA_LAYER_SCALE = 0.2  # the larger target's extra layers: output projections scaled by this


def build_larger_target(out_dir: str) -> str:
    """The demo model with its 4 layers repeated once more (outputs scaled by 0.2), saved with
    the demo's tokenizer: a target twice the demo's size whose distribution is near the demo's."""
    import shutil

    import torch

    demo = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL, torch_dtype=torch.bfloat16)
    config = demo.config
    n = config.num_hidden_layers
    config.num_hidden_layers = 2 * n
    target = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    state = demo.state_dict()
    with torch.no_grad():
        for name, value in target.state_dict().items():
            if name.startswith("model.layers."):
                layer = int(name.split(".")[2])
                source = name.replace(f"model.layers.{layer}.", f"model.layers.{layer % n}.", 1)
                scale = (
                    EXTRA_LAYER_SCALE if layer >= n and name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
                )
                value.copy_(state[source] * scale)
            else:
                value.copy_(state[name])
    target.save_pretrained(out_dir, safe_serialization=True)
    for name in os.listdir(DEMO_MODEL):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(DEMO_MODEL, name), out_dir)
    return out_dir


BATCHES = (1, 8, 64)
TEMPERATURES = (0.0, 0.8)


def prompts(count: int, tokens: int) -> list[str]:
    """`count` prompts of about `tokens` tokens: consecutive held-out verses."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL)
    with open(HELDOUT_FILE, encoding="utf-8") as f:
        verses = [line.strip() for line in f if line.strip()]
    out, i = [], 0
    while len(out) < count:
        text = ""
        while len(tokenizer.encode(text)) < tokens:
            text += verses[i % len(verses)] + " "
            i += 1
        out.append(text.strip())
    return out


def measure(llm: LLM, texts: list[str], temperature: float, max_tokens: int) -> dict:
    params = [
        SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i)
        for i in range(len(texts))
    ]
    engine = llm.llm_engine
    before = dict(engine.spec_stats)
    start = time.perf_counter()
    outputs = llm.generate(texts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    row = dict(seconds=seconds, output_tokens=generated, output_tokens_per_s=generated / seconds)
    if before:
        drafts = engine.spec_stats["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = engine.spec_stats["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        row.update(draft_tokens=drafts, accepted_tokens=accepted, acceptance_rate=accepted / max(drafts, 1))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--batches", type=lambda t: [int(x) for x in t.split(",")], default=list(BATCHES))
    parser.add_argument("--part", choices=sorted(CONFIGS), default="ngram", help="which comparison (see above)")
    parser.add_argument(
        "--every-step",
        action="store_true",
        help='speculate in every step that can ("adaptive": false), not as the governor decides',
    )
    parser.add_argument("--json", default=None, help="write the results here (and a .md table beside it)")
    args = parser.parse_args()
    texts = prompts(max(args.batches), args.prompt_tokens)
    target = DEMO_MODEL if args.part == "ngram" else build_larger_target(tempfile.mkdtemp(prefix="demo_x2_"))
    rows = []
    for name, spec in CONFIGS[args.part].items():
        spec = {**spec, "adaptive": False} if spec is not None and args.every_step else spec
        llm = LLM(
            model=target,
            max_num_seqs=max(args.batches),
            max_model_len=args.prompt_tokens * 2 + args.max_tokens,
            speculative_config=spec,
        )
        measure(llm, texts[:2], 0.0, 8)  # warm-up: every program is compiled, this runs them once
        for batch in args.batches:
            for temperature in TEMPERATURES:
                row = dict(
                    config=name,
                    batch=batch,
                    temperature=temperature,
                    **measure(llm, texts[:batch], temperature, args.max_tokens),
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
        del llm
    base = {(r["batch"], r["temperature"]): r["output_tokens_per_s"] for r in rows if r["config"] == "plain"}
    for r in rows:
        r["speedup_vs_plain"] = r["output_tokens_per_s"] / base[(r["batch"], r["temperature"])]
    lines = ["| config | batch | temperature | output tokens/s | vs plain | acceptance |", "|---|---|---|---|---|---|"]
    for r in rows:
        acceptance = f"{r['acceptance_rate']:.0%}" if "acceptance_rate" in r else ""
        lines.append(
            f"| {r['config']} | {r['batch']} | {r['temperature']} | {r['output_tokens_per_s']:.1f} | "
            f"{r['speedup_vs_plain']:.2f}x | {acceptance} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.json:
        report = dict(
            device=platform.processor() or platform.machine(),
            jax_version=jax.__version__,
            part=args.part,
            max_tokens=args.max_tokens,
            prompt_tokens=args.prompt_tokens,
            results=rows,
        )
        save_results(args.json, report, table)


if __name__ == "__main__":
    main()
