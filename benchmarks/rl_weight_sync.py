"""The engine in a training loop, measured on this machine (CPU by default):

1. `update_weights` vs building a new engine on the new weights (dummy weights of a ~150M
   Llama, or Llama-3.2-1B's shapes with `--shape llama-3.2-1b`; the build compiles unless the
   compilation cache has the programs: both are given), for the trainer's arrays shared (no
   copy), host (numpy) arrays (copied once), Hugging Face `(name, array)` pairs (vLLM's
   `load_weights`) and plain bfloat16 weights re-quantized by an fp8 engine; with the bytes each
   update copied, its bytes/s, and its time over a plain `jax.device_put` of the same host
   arrays to the engine's shardings in the same run (the floor of any update that copies).
2. The train-inference log-probability gap on the demo model: the engine's sampled tokens'
   log-probabilities against the scoring path (`jaxpaged.functional.token_logprobs`, the
   engine's model code) and against an independent implementation (transformers, torch), in
   float32 and bfloat16: mean and max |delta|.

    python -m benchmarks.rl_weight_sync --out benchmarks/results/rl_weight_sync_cpu.json
    python -m benchmarks.rl_weight_sync --shape llama-3.2-1b --parts weight_sync \
        --out benchmarks/results/rl_weight_sync_cpu_llama32_1b.json
"""

import argparse
import json
import os
import tempfile
import time

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from benchmarks.results_files import save_results
from benchmarks.speculative_gpu import LLAMA_32_1B_OVERRIDES
from jaxpaged import LLM, SamplingParams
from jaxpaged.checkpoint.hf_keys import hf_key_specs
from jaxpaged.config.defaults import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from jaxpaged.config.presets import get_preset
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.setup import build_model
from jaxpaged.engine_args import EngineArgs
from jaxpaged.functional import token_logprobs

SHAPES = {  # config.json of each model shape measured (dummy weights: no checkpoint is read)
    "150m": {  # ~150M parameters (bfloat16: ~0.3 GB)
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # Llama-3.2-1B's shapes (1.24B parameters, bfloat16: 2.47 GB)
    "llama-3.2-1b": {**get_preset("llama-3.1-8b"), **LLAMA_32_1B_OVERRIDES},
}
PARTS = ("logprob_gap", "weight_sync")


def timed(fn):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(jax.tree.leaves(out))
    return out, time.perf_counter() - start


def update(target: LLMEngine, weights):
    """`update_weights`, timed until the engine holds the new weights (its copies and quantizers
    run asynchronously): (stats, seconds)."""
    start = time.perf_counter()
    stats = target.update_weights(weights)
    jax.block_until_ready(jax.tree.leaves(target.get_params()))
    return stats, time.perf_counter() - start


def engine(path: str, seed: int, quantization: str | None = None) -> LLMEngine:
    args = EngineArgs(
        model=path,
        load_format="dummy",
        dtype="bfloat16",
        quantization=quantization,
        seed=seed,
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_seqs=4,
    )
    built = LLMEngine(args)
    jax.block_until_ready(jax.tree.leaves(built.get_params()))  # the dummy weights are made asynchronously
    return built


def copy_rate(seconds: float, nbytes: int, device_put: dict) -> dict:
    """An update's time, its bytes/s, and its time over the plain device_puts of the same bytes."""
    return {
        "seconds": seconds,
        "bytes_per_s": nbytes / seconds,
        "over_device_put": seconds / device_put["seconds"],
        "over_device_put_copying": seconds / device_put["copying_seconds"],
    }


def weight_sync(shape: str) -> dict:
    path = tempfile.mkdtemp(prefix="rl-weights-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(SHAPES[shape], f)
    a, build_first = timed(lambda: engine(path, 0))
    b, build_cached = timed(lambda: engine(path, 1))
    weights = sum(x.nbytes for x in jax.tree.leaves(b.get_params()))
    out = {"shape": shape, "config": SHAPES[shape], "dtype": "bfloat16", "weight_bytes": weights}
    out["build_engine_s"] = {"compiling": build_first, "compilation_cache_warm": build_cached}
    _, out["get_params_s"] = timed(lambda: b.get_params())
    stats, seconds = update(a, b.get_params())
    out["update_shared"] = {"seconds": seconds, "copied_bytes": stats.copied_bytes, "shared_bytes": stats.shared_bytes}
    # copies in host memory: on a CPU np.asarray would view the engine's own buffers
    host = jax.tree.map(lambda x: np.array(x, copy=True), b.get_params())
    shardings = jax.tree.map(lambda x: x.sharding, b.get_params())
    # The floor of a copying update: the same host arrays put where the engine keeps them, as
    # update_weights puts them, and with a copy forced (may_alias=False).
    _, seconds = timed(lambda: jax.device_put(host, shardings))
    _, copying = timed(lambda: jax.device_put(host, shardings, may_alias=False))
    device_put = out["device_put"] = {"seconds": seconds, "bytes_per_s": weights / seconds, "copying_seconds": copying}
    stats, seconds = update(a, host)
    out["update_from_host"] = {"copied_bytes": stats.copied_bytes, **copy_rate(seconds, weights, device_put)}
    host = None
    config = a.runner.parallel.layout.config
    shapes = {s.hf_name: s.hf_shape for s in hf_key_specs(config)}  # a fused tensor once
    pairs = [(name, np.full(shape, 0.01, ml_dtypes.bfloat16)) for name, shape in shapes.items()]
    hf_bytes = sum(x.nbytes for _, x in pairs)
    stats, seconds = update(a, pairs)
    out["update_from_hf_pairs"] = {
        "tensors": len(pairs),
        "hf_bytes": hf_bytes,
        "copied_bytes": stats.copied_bytes,
        **copy_rate(seconds, hf_bytes, device_put),
    }
    a = pairs = None  # gone before the fp8 engine is built
    fp8, build_fp8 = timed(lambda: engine(path, 0, "fp8"))
    plain = nnx.state(build_model(b.config, fp8.runner.parallel))  # a trainer's plain bfloat16 weights
    jax.block_until_ready(jax.tree.leaves(plain))
    stats, first = update(fp8, plain)  # compiles the quantizer of each weight shape
    stats, seconds = update(fp8, plain)
    out["update_fp8_requantize"] = {
        "seconds": seconds,
        "first_seconds_compiling": first,
        "quantized_bytes": stats.quantized_bytes,
        "copied_bytes": stats.copied_bytes,
        "build_fp8_engine_s": build_fp8,
    }
    return out


def table(sync: dict) -> str:
    """The markdown table of a weight-sync run."""
    gb = sync["weight_bytes"] / 1e9
    rows = [
        ("a new engine on the new weights, compiling", sync["build_engine_s"]["compiling"], "(all)", ""),
        (
            "a new engine, its programs in the compilation cache",
            sync["build_engine_s"]["compilation_cache_warm"],
            "(all)",
            "",
        ),
        ("`get_params()`", sync["get_params_s"], "0", ""),
        ("`update_weights`, the trainer's arrays on the engine's devices", sync["update_shared"]["seconds"], "0", ""),
        ("`jax.device_put` of the same host arrays (the floor)", sync["device_put"]["seconds"], f"{gb:.2f} GB", "1.00"),
        (
            "`jax.device_put(..., may_alias=False)` (a copy forced)",
            sync["device_put"]["copying_seconds"],
            f"{gb:.2f} GB",
            "",
        ),
    ]
    for key, what in (("update_from_host", "host (numpy) arrays"), ("update_from_hf_pairs", "Hugging Face pairs")):
        r = sync[key]
        rows.append(
            (
                f"`update_weights`, {what}",
                r["seconds"],
                f"{r['copied_bytes'] / 1e9:.2f} GB",
                f"{r['over_device_put']:.2f}",
            )
        )
    q = sync["update_fp8_requantize"]
    rows.append(
        (
            "`update_weights`, plain bfloat16 into an fp8 engine",
            q["seconds"],
            f"0 ({q['quantized_bytes'] / 1e9:.2f} GB quantized)",
            "",
        )
    )
    lines = [
        f"{sync['shape']}, {gb:.2f} GB of bfloat16 dummy weights",
        "",
        "| operation | seconds | bytes copied | over device_put |",
        "|---|---|---|---|",
    ]
    lines += [f"| {what} | {seconds:.4g} | {copied} | {ratio} |" for what, seconds, copied, ratio in rows]
    return "\n".join(lines)


def logprob_gap(dtype: str, num_prompts: int = 8, max_tokens: int = 32) -> dict:
    import torch
    import transformers

    llm = LLM(DEMO_MODEL_NAME, dtype=dtype, max_model_len=128, max_num_seqs=num_prompts, seed=0)
    prompts = ["And God said", "In the beginning", "Blessed are", "The LORD is my"] * (num_prompts // 4)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, seed=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    score = jax.jit(token_logprobs, static_argnums=0)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    hf = transformers.AutoModelForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch_dtype)
    with_path, without = [], []
    for out in outs:
        c = out.outputs[0]
        seq = list(out.prompt_token_ids) + list(c.token_ids)
        sampled = np.array([e[t].logprob for t, e in zip(c.token_ids, c.logprobs)])
        start = len(out.prompt_token_ids) - 1
        ours = np.asarray(score(llm.get_graphdef(), llm.get_params(), np.array([seq], np.int32)))[0, start:]
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits.float()
        theirs = torch.log_softmax(logits, -1)[0, :-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()
        with_path.append(np.abs(ours - sampled))
        without.append(np.abs(theirs[start:] - sampled))
    stat = lambda d: {"mean_abs": float(np.concatenate(d).mean()), "max_abs": float(np.concatenate(d).max())}  # noqa: E731
    return {
        "tokens": int(sum(len(d) for d in with_path)),
        "with_scoring_path": stat(with_path),
        "without_transformers": stat(without),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="write the results to this JSON file (and a .md table)")
    parser.add_argument("--shape", choices=SHAPES, default="150m", help="the model shape of the weight-sync part")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated parts to run, of {PARTS}")
    args = parser.parse_args()
    parts = args.parts.split(",")
    if unknown := sorted(set(parts) - set(PARTS)):
        parser.error(f"--parts {args.parts!r}: unknown {unknown}; choose from {PARTS}")
    result = {"device": str(jax.devices()[0].device_kind)}
    if "logprob_gap" in parts:
        result["logprob_gap"] = {dtype: logprob_gap(dtype) for dtype in ("float32", "bfloat16")}
        print(json.dumps(result["logprob_gap"]), flush=True)
    if "weight_sync" in parts:
        result["weight_sync"] = weight_sync(args.shape)
    print(json.dumps(result, indent=1))
    if args.out:
        save_results(args.out, result, table(result["weight_sync"]) if "weight_sync" in result else "")


if __name__ == "__main__":
    main()
