"""LoRA's cost against the base model, in the same run: decode throughput of one engine without
LoRA, and of one with `enable_lora` (4 slots and 16 slots, rank 16) serving the base model, one
adapter, and 4 (or 16) adapters mixed, at batch 1 and 16 (prompts of 32 tokens, 64 greedy
tokens each, EOS ignored; best of two runs). Adapters are PEFT adapters of the model (q/k/v/o
and the MLP, rank 16) made here with random weights.

    python -m benchmarks.lora_overhead [--batches 1 16] [--output benchmarks/results/lora_overhead_cpu_demo.json]

On this machine's CPU attention and the MLP run in XLA:CPU, so the ratios say what the two
einsums per projection cost beside the model's own matmuls at the demo model's widths (d 256),
not a GPU's numbers.
"""

import argparse
import os
import tempfile
import time

from benchmarks.results_files import save_results
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
from jaxpaged.entrypoints.llm import LLM
from jaxpaged.lora_request import LoRARequest
from jaxpaged.sampling_params import SamplingParams

PROMPT_LEN, OUTPUT_LEN, RANK = 32, 64, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(count: int, root: str) -> list[LoRARequest]:
    """`count` PEFT adapters of the demo model with random weights."""
    import peft
    import torch
    import transformers

    adapters = []
    for i in range(count):
        torch.manual_seed(i)
        base = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32)
        config = peft.LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS, init_lora_weights=False)
        path = os.path.join(root, f"adapter-{i}")
        peft.get_peft_model(base, config).save_pretrained(path)
        adapters.append(LoRARequest(f"adapter-{i}", i + 1, path))
    return adapters


def tokens_per_second(llm: LLM, batch: int, loras: list[LoRARequest | None]) -> float:
    """Output tokens/s of `batch` requests, request i with `loras[i % len(loras)]`; best of two."""
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    best = 0.0
    for run in range(2):
        prompts = [
            {"prompt_token_ids": [(7 * i + j + 31 * run) % 500 + 3 for j in range(PROMPT_LEN)]} for i in range(batch)
        ]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False, lora_request=[loras[i % len(loras)] for i in range(batch)])
        best = max(best, batch * OUTPUT_LEN / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--output", default="benchmarks/results/lora_overhead_cpu_demo.json")
    args = parser.parse_args()
    common = dict(max_num_seqs=max(args.batches), num_scheduler_steps=1, dtype="float32")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        adapters = make_adapters(16, root)
        engines = {"no LoRA": LLM(DEMO_MODEL_DIR, **common)}
        for slots in (4, 16):
            engines[f"{slots} slots"] = LLM(
                DEMO_MODEL_DIR, enable_lora=True, max_loras=slots, max_lora_rank=RANK, **common
            )
        for batch in args.batches:
            base = tokens_per_second(engines["no LoRA"], batch, [None])
            rows.append(dict(engine="no LoRA", adapters=0, batch=batch, tokens_per_s=round(base, 1), ratio=1.0))
            for slots in (4, 16):
                for used in sorted({0, 1, slots}):
                    loras = adapters[:used] or [None]
                    tps = tokens_per_second(engines[f"{slots} slots"], batch, loras)
                    rows.append(
                        dict(
                            engine=f"{slots} slots",
                            adapters=used,
                            batch=batch,
                            tokens_per_s=round(tps, 1),
                            ratio=round(tps / base, 3),
                        )
                    )
                    print(rows[-1], flush=True)
    lines = ["| engine | adapters in the batch | batch | tokens/s | vs no LoRA |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['engine']} | {r['adapters']} | {r['batch']} | {r['tokens_per_s']} | {r['ratio']:.3f} |" for r in rows
    ]
    table = "\n".join(lines)
    print(table)
    save_results(args.output, {"prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "rank": RANK, "rows": rows}, table)


if __name__ == "__main__":
    main()
