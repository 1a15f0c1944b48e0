"""Mixture of experts on the CPU: does the cost follow top-k or the number of experts?

1. A Mixtral-shaped tiny model (dummy weights) with 8 and with 32 experts at top-2: decode
   time per step through the `LLM` API (`benchmarks/step_time.py`: batch 1 and 8, 128-token
   prompts, 64 greedy tokens, best of 3).
2. The experts' FFN alone, decode-shaped (8 tokens) and prefill-shaped (512 tokens), top-2,
   8 and 32 experts: jaxpaged's tiled grouped matmul (`jaxpaged.model.moe.experts_ffn`),
   `jax.lax.ragged_dot` (sorted rows, group sizes) and the dense all-experts reference
   (`dense_experts_reference`), each jitted, median of 20 calls.

    python -m benchmarks.moe_cpu benchmarks/results/moe_cpu.json
"""

import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import step_time
from benchmarks.results_files import save_results
from jaxpaged.model.moe import combine, dense_experts_reference, experts_ffn, sort_by_expert

MIXTRAL_TINY = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_experts_per_tok": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
}
TOP_K, D, F = 2, 256, 512


def decode_ms_per_step(num_experts: int) -> dict:
    """`benchmarks/step_time.py`'s batch-1 and batch-8 decode ms per step, dummy weights."""
    with tempfile.TemporaryDirectory() as model_dir:
        with open(os.path.join(model_dir, "config.json"), "w") as f:
            json.dump({**MIXTRAL_TINY, "num_local_experts": num_experts}, f)
        return step_time.main(model_dir, f"{num_experts} experts", {})


def ragged_dot_ffn(arrays, x, weights, experts):
    order, group_sizes = sort_by_expert(experts, arrays["gate_proj"].shape[0])
    rows = x[order // TOP_K]
    gate = jax.lax.ragged_dot(rows, arrays["gate_proj"], group_sizes)
    up = jax.lax.ragged_dot(rows, arrays["up_proj"], group_sizes)
    return combine(jax.lax.ragged_dot(jax.nn.silu(gate) * up, arrays["down_proj"], group_sizes), order, weights)


def dense_ffn(arrays, x, weights, experts):
    return dense_experts_reference(x, weights, experts, arrays["gate_proj"], arrays["up_proj"], arrays["down_proj"])


def grouped_ffn(arrays, x, weights, experts):
    return experts_ffn(arrays, None, TOP_K, x, weights, experts)


def ffn_ms(fn, num_tokens: int, num_experts: int) -> float:
    rng = np.random.default_rng(0)
    arrays = {
        n: jnp.asarray(0.05 * rng.normal(size=(num_experts, *s)), jnp.float32)
        for n, s in (("gate_proj", (D, F)), ("up_proj", (D, F)), ("down_proj", (F, D)))
    }
    x = jnp.asarray(rng.normal(size=(num_tokens, D)), jnp.float32)
    experts = jnp.asarray(np.stack([rng.permutation(num_experts)[:TOP_K] for _ in range(num_tokens)]), jnp.int32)
    weights = jnp.full((num_tokens, TOP_K), 0.5, jnp.float32)
    step = jax.jit(fn)
    step(arrays, x, weights, experts).block_until_ready()
    times = []
    for _ in range(20):
        start = time.perf_counter()
        step(arrays, x, weights, experts).block_until_ready()
        times.append(time.perf_counter() - start)
    return round(1000 * float(np.median(times)), 3)


def main(out_path: str) -> None:
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "top_k": TOP_K, "decode": {}, "ffn": []}
    for num_experts in (8, 32):
        report["decode"][num_experts] = decode_ms_per_step(num_experts)
    for num_tokens in (8, 512):
        for num_experts in (8, 32):
            row = {"tokens": num_tokens, "experts": num_experts}
            for name, fn in (("grouped", grouped_ffn), ("ragged_dot", ragged_dot_ffn), ("dense", dense_ffn)):
                row[f"{name}_ms"] = ffn_ms(fn, num_tokens, num_experts)
            report["ffn"].append(row)
    lines = [
        f"# Mixture of experts on the CPU ({report['device']}, jax {report['jax']}), top-{TOP_K}",
        "",
        "Mixtral-shaped tiny model (D 256, F 512, 4 layers, dummy weights), decode ms per step:",
        "",
        "| experts | batch 1 | batch 8 |",
        "|---|---|---|",
        *(f"| {e} | {r['batch1_ms_per_step']} | {r['batch8_ms_per_step']} |" for e, r in report["decode"].items()),
        "",
        f"The experts' FFN alone (D {D}, F {F}), median ms per call:",
        "",
        "| tokens | experts | grouped (tiled) | jax.lax.ragged_dot | dense all-experts |",
        "|---|---|---|---|---|",
        *(
            f"| {r['tokens']} | {r['experts']} | {r['grouped_ms']} | {r['ragged_dot_ms']} | {r['dense_ms']} |"
            for r in report["ffn"]
        ),
    ]
    save_results(out_path, report, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
