"""The engine in a training loop, measured on this machine (CPU by default):

1. `update_weights` vs building a new engine on the new weights (dummy weights of a ~150M
   Llama; the build compiles unless the compilation cache has the programs: both are given),
   for the trainer's arrays shared (no copy), host arrays (copied once) and plain bfloat16
   weights re-quantized by an fp8 engine; with the bytes each update copied.
2. The train-inference log-probability gap on the demo model: the engine's sampled tokens'
   log-probabilities against the scoring path (`jaxpaged.functional.token_logprobs`, the
   engine's model code) and against an independent implementation (transformers, torch), in
   float32 and bfloat16: mean and max |delta|.

    python -m benchmarks.rl_weight_sync --out benchmarks/results/rl_weight_sync_cpu.json
"""

import argparse
import json
import os
import tempfile
import time

import jax
import numpy as np

from jaxpaged import LLM, SamplingParams
from jaxpaged.config.defaults import DEMO_MODEL_DIR, DEMO_MODEL_NAME
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.functional import token_logprobs

CONFIG = {  # ~150M parameters (bfloat16: ~0.3 GB)
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
}


def timed(fn):
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(jax.tree.leaves(out) if not hasattr(out, "arrays") else [])
    return out, time.perf_counter() - start


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
    return LLMEngine(args)


def weight_sync() -> dict:
    path = tempfile.mkdtemp(prefix="rl-weights-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIG, f)
    a, build_first = timed(lambda: engine(path, 0))
    b, build_cached = timed(lambda: engine(path, 1))
    weights = sum(x.nbytes for x in jax.tree.leaves(b.get_params()))
    out = {
        "model": "Llama ~150M (hidden 1024, 8 layers, vocab 32000), bfloat16, dummy weights",
        "weight_bytes": weights,
    }
    out["build_engine_s"] = {"compiling": build_first, "compilation_cache_warm": build_cached}
    stats, seconds = timed(lambda: a.update_weights(b.get_params()))
    out["update_shared"] = {"seconds": seconds, "copied_bytes": stats.copied_bytes, "shared_bytes": stats.shared_bytes}
    host = jax.tree.map(np.asarray, b.get_params())
    stats, seconds = timed(lambda: a.update_weights(host))
    out["update_from_host"] = {"seconds": seconds, "copied_bytes": stats.copied_bytes}
    a = host = None  # gone before the fp8 engine is built
    fp8, build_fp8 = timed(lambda: engine(path, 0, "fp8"))
    from flax import nnx

    from jaxpaged.engine.setup import build_model

    plain = nnx.state(build_model(b.config, fp8.runner.parallel))  # a trainer's plain bfloat16 weights
    stats, first = timed(lambda: fp8.update_weights(plain))  # compiles the quantizer of each weight shape
    stats, seconds = timed(lambda: fp8.update_weights(plain))
    out["update_fp8_requantize"] = {
        "seconds": seconds,
        "first_seconds_compiling": first,
        "quantized_bytes": stats.quantized_bytes,
        "copied_bytes": stats.copied_bytes,
        "build_fp8_engine_s": build_fp8,
    }
    return out


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
    parser.add_argument("--out", default=None, help="write the results to this JSON file")
    args = parser.parse_args()
    result = {"device": str(jax.devices()[0].device_kind)}
    result["logprob_gap"] = {dtype: logprob_gap(dtype) for dtype in ("float32", "bfloat16")}
    print(json.dumps(result["logprob_gap"]), flush=True)
    result["weight_sync"] = weight_sync()
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
