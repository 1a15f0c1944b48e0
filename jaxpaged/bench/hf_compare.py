"""Hugging Face transformers on the same requests as `bench throughput`, in a process of its own.

    python -m jaxpaged.bench.hf_compare WORKLOAD.json RESULT.json

WORKLOAD.json holds `model` (a directory with config.json), `dtype`, `load_format` (auto reads
the weights, dummy initialises random ones), `max_batch_size`, `prompts` (token-id lists) and
`output_lens`. EOS is ignored, so every request generates exactly its output length.

Where transformers has continuous batching (`generate_batch`, transformers >= 4.56) the requests
go through its manager (the one `generate_batch` runs on; it is driven directly because
`generate_batch` takes one `max_new_tokens` for all requests) and the clock runs from the first
request to the last result, after the manager's warm-up. Otherwise batched `generate` runs
`max_batch_size` prompts at a time, left-padded, each batch to its longest output (that waste is
static batching's cost); a small warm-up batch goes first. Sampling is vLLM's (temperature 1,
top-p 1) in both.
"""

import json
import os
import sys
import time

WARMUP_REQUESTS = 2


def load_model(workload: dict):
    """The transformers model of the workload, on CUDA when torch sees a GPU."""
    import torch
    import transformers

    dtype = getattr(torch, workload["dtype"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if workload["load_format"] == "dummy":
        config = transformers.AutoConfig.from_pretrained(workload["model"])
        with torch.device(device):  # initialise on the GPU: an 8B model on the CPU takes minutes
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(workload["model"], dtype=dtype)
    return model.to(device).eval()


def run_continuous_batching(model, prompts: list[list[int]], output_lens: list[int]) -> tuple[float, int]:
    """Seconds and generated tokens through transformers' continuous-batching manager."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_p=1.0, eos_token_id=None, max_new_tokens=max(output_lens)
    )
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=5) as manager:
        start = time.perf_counter()
        for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
            manager.add_request(prompt, request_id=str(i), max_new_tokens=n)
        finished = {}
        while len(finished) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"transformers request {result.request_id} failed: {result.error}")
                finished[result.request_id] = len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous-batching thread stopped before finishing")
        seconds = time.perf_counter() - start
    return seconds, sum(finished.values())


def run_batched_generate(model, prompts: list[list[int]], output_lens: list[int], batch_size: int) -> tuple[float, int]:
    """Seconds and requested tokens through batched `generate` (each batch to its longest output)."""
    import torch

    def generate(batch: list[list[int]], new_tokens: int) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                pad_token_id=0,
            )

    generate(prompts[:WARMUP_REQUESTS], 4)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        generate(prompts[i : i + batch_size], max(output_lens[i : i + batch_size]))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, sum(output_lens)


def main(argv: list[str]) -> int:
    """Runs the workload file `argv[0]` and writes the result JSON to `argv[1]`."""
    import torch
    import transformers

    with open(argv[0]) as f:
        workload = json.load(f)
    torch.set_num_threads(os.cpu_count() or 1)
    model = load_model(workload)
    model.generation_config.eos_token_id = None
    prompts, output_lens = workload["prompts"], workload["output_lens"]
    if hasattr(model, "continuous_batching_context_manager"):
        backend = "transformers continuous batching (generate_batch's manager)"
        seconds, generated = run_continuous_batching(model, prompts, output_lens)
    else:
        backend = f"transformers batched generate (batches of {workload['max_batch_size']})"
        seconds, generated = run_batched_generate(model, prompts, output_lens, workload["max_batch_size"])
    if generated != sum(output_lens):
        raise RuntimeError(f"transformers generated {generated} tokens, not the {sum(output_lens)} asked for")
    prompt_tokens = sum(len(p) for p in prompts)
    result = {
        "backend": backend,
        "transformers_version": transformers.__version__,
        "device": str(model.device),
        "elapsed_time": seconds,
        "num_requests": len(prompts),
        "total_num_tokens": prompt_tokens + generated,
        "total_output_tokens": generated,
        "requests_per_second": len(prompts) / seconds,
        "tokens_per_second": (prompt_tokens + generated) / seconds,
        "output_tokens_per_second": generated / seconds,
    }
    with open(argv[1], "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
