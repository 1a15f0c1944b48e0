"""What a lent GPU should measure about speculative decoding, in one device call of at most 10 minutes:
the 8B engine's batch-1 (and batch-8) TPOT on repetitive prompts with n-gram speculation vs without.

    bash benchmarks/run_gpu_speculative.sh "$OUT"               # on the GPU machine (this script, --out "$OUT")
    python -m benchmarks.speculative_gpu --smoke --out /tmp/s   # the whole run on a CPU: demo model, tiny shapes

Nothing needs preparing or carrying: the engines use dummy weights (Llama-3.1-8B's shapes, bf16)
and prompts of random token ids. Conventions as in `quantization_gpu.py` (and `gpu_run.py`, whose
device probe, stage loop and console tee, in `gpu/orchestrate.py`, this reuses, with
`gpu/stages.Stage` and `gpu/runner`): the device is probed in a process of its own; every step runs in a process group
of its own with its own timeout (what its stage has left; a stage's unused seconds go to the
next); OUT/summary.json, OUT/summary.md and OUT/stages.tar.gz are rewritten after every stage;
OUT/console.txt holds the timestamped console.

Stages (budgets in STAGE_BUDGETS_S; they and the probe sum to 9.5 minutes), each one engine
measured by `gpu/spec_latency.py` (batch 1 then batch 8: prompts of a random 32-token phrase
repeated to 512 tokens, 256 greedy output tokens; TPOT from the full run minus a prefill-only
run), all with the same engine limits and one persistent compilation cache in the work directory:

1. plain: no speculation (the ratios' base).
2. ngram_k2, ngram_k4: n-gram speculation, k = 2 and 4 (prompt_lookup_max 4, min 1): TPOT,
   tokens/s, acceptance (`get_stats()`' proposed / accepted tokens), ratios to plain.
3. draft: the 8B target with a Llama-3.2-1B-shaped draft (config.json written into the work
   directory: 8B's vocabulary, dummy weights of its own), k = 4. Its proposals are near-random,
   so this measures the overhead of catching up and proposing, not acceptance.

With dummy weights acceptance is not representative: a random model decoding greedily often
repeats a short cycle, which n-gram lookup predicts (the summary's notes say so).
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys

from benchmarks.gpu.orchestrate import add_run_args, check_run_args, chosen_stages, orchestrate, run_stage_loop
from benchmarks.gpu.plan import DEMO_MODEL_DIR, ROOT
from benchmarks.gpu.spec_summary import write_summary
from benchmarks.gpu.stages import Stage

# Seconds per stage, most valuable first; with the device probe (at most 20 s) they sum to 9.5 minutes.
STAGE_BUDGETS_S = {"plain": 150, "ngram_k2": 120, "ngram_k4": 120, "draft": 160}
SMOKE_STAGE_BUDGET_S = 120
# The speculative_config of each stage (None: plain decoding; "DRAFT" stands for the draft's directory).
# "adaptive": False makes every step speculate: these stages measure what speculation itself costs
# and gains on the GPU (the data the engine's SpeculationGovernor decides from), not the governor's
# choice, which on a fast plain step may be to not speculate at all.
SPEC_CONFIGS = {
    "plain": None,
    **{
        name: {**spec, "adaptive": False}
        for name, spec in {
            "ngram_k2": {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 1,
            },
            "ngram_k4": {
                "method": "ngram",
                "num_speculative_tokens": 4,
                "prompt_lookup_max": 4,
                "prompt_lookup_min": 1,
            },
            "draft": {"model": "DRAFT", "num_speculative_tokens": 4},
        }.items()
    },
}
# Llama-3.2-1B's public shapes (its config.json on the Hub), with Llama-3.1-8B's vocabulary.
LLAMA_32_1B_OVERRIDES = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "rope_scaling": {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
# The smoke run's draft: a smaller model than the demo, with its vocabulary.
SMOKE_DRAFT_OVERRIDES = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything the stages need to build their commands."""

    smoke: bool
    model: str
    weight_flags: tuple[str, ...]
    engine_limits: tuple[str, ...]
    measure_flags: tuple[str, ...]
    draft_overrides: dict  # the draft's config.json: the target's, with these keys replaced
    budgets_s: dict


def gpu_plan(budgets: dict) -> Plan:
    """Llama-3.1-8B's shapes with dummy bf16 weights on the GPU. Limits sized to the workload
    (8 sequences of 512 + 256 tokens): 6 mixed-step programs and 1 fused-decode program per engine."""
    return Plan(
        smoke=False,
        model="llama-3.1-8b",
        weight_flags=("--dtype", "bfloat16", "--load-format", "dummy"),
        engine_limits=("--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "512"),
        measure_flags=(
            "--batch-sizes",
            "1,8",
            "--input-len",
            "512",
            "--phrase-len",
            "32",
            "--output-len",
            "256",
            "--num-iters-warmup",
            "1",
            "--num-iters",
            "3",
        ),
        draft_overrides=LLAMA_32_1B_OVERRIDES,
        budgets_s={**STAGE_BUDGETS_S, **budgets},
    )


def smoke_plan(budgets: dict) -> Plan:
    """The demo model, tiny limits and workloads: the whole run on a CPU."""
    return Plan(
        smoke=True,
        model=DEMO_MODEL_DIR,
        weight_flags=("--dtype", "bfloat16", "--load-format", "dummy", "--skip-tokenizer-init"),
        engine_limits=(
            "--max-model-len",
            "64",
            "--max-num-seqs",
            "2",
            "--max-num-batched-tokens",
            "16",
            "--num-scheduler-steps",
            "1",
        ),
        measure_flags=(
            "--batch-sizes",
            "1,2",
            "--input-len",
            "16",
            "--phrase-len",
            "4",
            "--output-len",
            "8",
            "--num-iters-warmup",
            "0",
            "--num-iters",
            "1",
        ),
        draft_overrides=SMOKE_DRAFT_OVERRIDES,
        budgets_s={**{name: SMOKE_STAGE_BUDGET_S for name in STAGE_BUDGETS_S}, **budgets},
    )


def write_draft_config(plan: Plan, directory: str) -> str:
    """A config.json (no weights: the engine makes dummy ones) of the draft model; its directory."""
    from jaxpaged.config.presets import load_config_dict

    config = {**load_config_dict(plan.model)[1], **plan.draft_overrides}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return directory


def run_config(stage: Stage, name: str) -> None:
    plan = stage.plan
    spec = SPEC_CONFIGS[name]
    if spec is not None and spec.get("model") == "DRAFT":
        spec = {**spec, "model": write_draft_config(plan, stage.path("draft_model"))}
    out = stage.path(f"{name}.result.json")
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu.spec_latency",
        "--model",
        plan.model,
        *plan.weight_flags,
        *plan.engine_limits,
        "--compilation-cache-dir",
        stage.path("engine_xla_cache"),
        *plan.measure_flags,
        "--label",
        name,
        "--output-json",
        out,
    ]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    stage.step("latency", cmd, out)


def run_stages(args, plan: Plan, out_dir: str, work_dir: str, device: dict, env: dict) -> list[dict]:
    chosen = chosen_stages(args, STAGE_BUDGETS_S)
    values = dict(zip(plan.measure_flags[::2], plan.measure_flags[1::2]))
    plan_info = {
        "smoke": plan.smoke,
        "model": plan.model,
        "dtype": "bf16",
        "engine_limits": plan.engine_limits,
        "measure_flags": plan.measure_flags,
        "speculative_configs": {n: SPEC_CONFIGS[n] for n in chosen},
        "draft_overrides": plan.draft_overrides,
        "workload": f"{values['--input-len']}-token prompts (a random {values['--phrase-len']}-token phrase "
        f"repeated), {values['--output-len']} output tokens",
        "budgets_s": {name: plan.budgets_s[name] for name in chosen},
    }
    shutil.rmtree(os.path.join(work_dir, "engine_xla_cache"), ignore_errors=True)
    return run_stage_loop(
        chosen,
        plan,
        work_dir,
        env,
        Stage,
        lambda name, stage: run_config(stage, name),
        lambda records: write_summary(out_dir, work_dir, device, records, plan_info),
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(
        parser,
        STAGE_BUDGETS_S,
        os.path.join(ROOT, "benchmarks", "results", "speculative_gpu_run"),
        "each stage's files and the compilation cache; new or empty (default: a fresh temporary directory)",
        "; without plain there are no ratios",
    )
    args = parser.parse_args(argv)
    check_run_args(parser, args, STAGE_BUDGETS_S)
    return orchestrate(
        args, "jaxpaged_spec_gpu_", smoke_plan if args.smoke else gpu_plan, run_stages, write_summary, 9, json.dumps
    )


if __name__ == "__main__":
    sys.exit(main())
