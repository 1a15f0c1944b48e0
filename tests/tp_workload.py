"""The workload of the tensor-parallel tests (one process and several): prompts sharing a
prefix, and engine options whose pool is too small for them at once, so prefix caching,
chunked prefill and preemption all happen, for any tensor-parallel size."""

import numpy as np

from jaxpaged.config.hf_config import read_model_config
from jaxpaged.config.model_config import kv_bytes_per_token
from jaxpaged.parallel.pipeline import PipelineLayout
from jaxpaged.parallel.sharding import TensorParallelLayout

BLOCK_SIZE = 8
POOL_BLOCKS = 8  # per device; fewer than the workload's sequences need at once


def prompts(seed: int = 0) -> list[list[int]]:
    """Three prompts sharing a 20-token prefix, two of their own (token ids below 500)."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 500, size=20).tolist()
    out = [shared + rng.integers(3, 500, size=n).tolist() for n in (3, 9, 1)]
    return out + [rng.integers(3, 500, size=n).tolist() for n in (5, 30)]


def engine_options(path: str, n: int, pp: int = 1) -> dict:
    """`EngineArgs` keywords for a float32 model directory on `n` devices per stage and `pp`
    stages, with a pool of `POOL_BLOCKS` blocks per device (what one device holds shrinks with
    `n`)."""
    config = read_model_config(path)
    layout = TensorParallelLayout(config, n, pipeline=PipelineLayout(config.num_layers, pp))
    per_token = kv_bytes_per_token(layout.device_config, 4)
    return dict(
        model=path,
        dtype="float32",
        tensor_parallel_size=n,
        pipeline_parallel_size=pp,
        skip_tokenizer_init=True,
        max_model_len=48,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=(POOL_BLOCKS + 1) * per_token * BLOCK_SIZE,
    )


def run(engine, prompts: list[list[int]], params) -> list:
    """Adds every prompt (as token ids) to `engine`, steps it until all finish; returns each
    request's first `CompletionOutput`, in the prompts' order."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((int(o.request_id), o) for o in engine.step() if o.finished)
    return [done[i].outputs[0] for i in range(len(prompts))]
