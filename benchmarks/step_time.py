"""Decode time per step through the `LLM` API only, so the same script times any commit.

Runs batch 1 and batch 8 (128-token prompts, 64 greedy tokens, EOS ignored, best of 3 after a
warm-up) and prints one JSON line. Compare commits by running it with each tree on PYTHONPATH
(by its path, not with -m: it imports only jaxpaged, and -m would put this checkout first):

    PYTHONPATH=/path/to/old/tree python benchmarks/step_time.py MODEL_DIR "before"
    python benchmarks/step_time.py MODEL_DIR "scanned" '{"scan_layers": true, "compilation_cache_dir": "none"}'

MODEL_DIR needs only a config.json (the weights are random: `load_format="dummy"`).
"""

import json
import sys
import time

from jaxpaged import LLM, SamplingParams


def main(model_dir: str, label: str, engine_kwargs: dict) -> dict:
    llm = LLM(
        model_dir,
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        num_scheduler_steps=4,
        **engine_kwargs,
    )
    result = {"label": label, **engine_kwargs}
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for batch in (1, 8):
        prompts = [{"prompt_token_ids": list(range(10 + i, 138 + i))} for i in range(batch)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
        result[f"batch{batch}_ms_per_step"] = round(1000 * min(times) / params.max_tokens, 3)
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})))
