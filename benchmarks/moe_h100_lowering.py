"""What the experts' FFN becomes in a program compiled for an H100 (XLA's deviceless compilation,
jaxpaged/bench/gpu_targets.py; needs JAX's CUDA plugin: the GPU machines' JAX 0.11), at
Mixtral-8x7B's shapes (D 4096, F 14336, 8 experts, top-2, bfloat16), decode-shaped (8 tokens)
and prefill-shaped (512 tokens):

- `jax.lax.ragged_dot` over the rows sorted by expert;
- jaxpaged's tiled grouped matmul (`jaxpaged.model.moe.experts_ffn`): XLA's loop over tiles;
- the same tiles through the Pallas grouped-matmul kernel (`kernels=True`, what the Pallas
  backend runs: `pallas_kernels/grouped_matmul.py`).

For each: the optimised HLO's dots with their operands' shapes (a contraction over E x D is the
dense all-experts product), its while loops, and the temporaries of its memory analysis (a
weight copied out per tile would show as a `[D, F]` temporary).

    python -m benchmarks.moe_h100_lowering benchmarks/results/moe_h100_lowering.json
"""

import re
import sys

from jaxpaged.bench.gpu_targets import compiling_for_target, prepare_environment

prepare_environment()

import jax  # noqa: E402 (after prepare_environment)
import jax.numpy as jnp  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from benchmarks.moe_cpu import ragged_dot_ffn  # noqa: E402
from benchmarks.results_files import save_results  # noqa: E402
from jaxpaged.model.moe import experts_ffn  # noqa: E402

D, F, E, TOP_K = 4096, 14336, 8, 2


def grouped(arrays, x, weights, experts):
    return experts_ffn(arrays, None, TOP_K, x, weights, experts)


def grouped_kernel(arrays, x, weights, experts):
    return experts_ffn(arrays, None, TOP_K, x, weights, experts, kernels=True)


def census(text: str) -> dict:
    """Each dot of optimised HLO as `operands -> result` (the parameter shapes of the computation
    holding it), the while loops, and the custom calls."""
    dots = set()
    for computation in text.split("\n\n"):
        for result in re.findall(r"= (\w+\[[\d,]*\])\{[^}]*\} dot\(", computation):
            operands = re.findall(r"= (\w+\[[\d,]*\])\{[^}]*\} parameter\(", computation)
            dots.add(f"{' x '.join(operands)} -> {result}")
    return {
        "dots": sorted(dots),
        "while_loops": len(re.findall(r" while\(", text)),
        "custom_calls": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))),
    }


def main(out_path: str) -> None:
    report = {"jax": jax.__version__, "target": "h100", "shapes": {"D": D, "F": F, "E": E, "top_k": TOP_K}, "runs": []}
    with compiling_for_target("h100", 1) as devices:
        on = SingleDeviceSharding(devices[0])
        arrays = {
            "gate_proj": jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16, sharding=on),
            "up_proj": jax.ShapeDtypeStruct((E, D, F), jnp.bfloat16, sharding=on),
            "down_proj": jax.ShapeDtypeStruct((E, F, D), jnp.bfloat16, sharding=on),
        }
        for tokens in (8, 512):
            args = (
                arrays,
                jax.ShapeDtypeStruct((tokens, D), jnp.bfloat16, sharding=on),
                jax.ShapeDtypeStruct((tokens, TOP_K), jnp.float32, sharding=on),
                jax.ShapeDtypeStruct((tokens, TOP_K), jnp.int32, sharding=on),
            )
            for name, fn in (
                ("ragged_dot", ragged_dot_ffn),
                ("grouped", grouped),
                ("grouped, Pallas kernel", grouped_kernel),
            ):
                compiled = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compile()
                memory = compiled.memory_analysis()
                run = {"program": name, "tokens": tokens, **census(compiled.as_text())}
                run["temp_bytes"] = int(memory.temp_size_in_bytes)
                report["runs"].append(run)
                print(run, flush=True)
    lines = [
        f"# The experts' FFN compiled for an H100 (jax {report['jax']}, deviceless), Mixtral-8x7B shapes",
        "",
        f"D {D}, F {F}, {E} experts, top-{TOP_K}, bfloat16.",
        "",
        "| program | tokens | dots (operands -> result) | while loops | temporaries |",
        "|---|---|---|---|---|",
        *(
            f"| {r['program']} | {r['tokens']} | {'; '.join(r['dots'])} | {r['while_loops']} | "
            f"{r['temp_bytes'] / 2**20:.1f} MiB |"
            for r in report["runs"]
        ),
    ]
    save_results(out_path, report, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
