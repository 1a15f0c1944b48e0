"""What a lent GPU should measure about speculative decoding, in one device call of at most 10 minutes:
the 8B engine's batch-1 (and batch-8) TPOT on repetitive prompts with n-gram speculation vs without.

    bash benchmarks/run_gpu.sh speculative "$OUT"               # on the GPU machine (this script, --out "$OUT")
    python -m benchmarks.speculative_gpu --smoke --out /tmp/s   # the whole run on a CPU: demo model, tiny shapes

Nothing needs preparing or carrying: the engines use dummy weights (Llama-3.1-8B's shapes, bf16)
and prompts of random token ids. The stages below, with this plan, run by the stage runner all GPU
runs share (`gpu/orchestrate.py`, as for `gpu_run.py`): the device is probed in a process of its
own; every step runs in a process group of its own with its own timeout (what its stage has left;
a stage's unused seconds go to the next); OUT/summary.json, OUT/summary.md (`gpu/spec_summary.py`)
and OUT/stages.tar.gz are rewritten after every stage; OUT/console.txt holds the timestamped console.

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

import dataclasses
import json
import os
import sys

from benchmarks.gpu.orchestrate import GpuRun, main
from benchmarks.gpu.plan import DEMO_MODEL_DIR, GPU_MODEL, GPU_WEIGHT_FLAGS, SMOKE_DUMMY_WEIGHT_FLAGS, Plan
from benchmarks.gpu.spec_summary import SUMMARY
from benchmarks.gpu.stage import Stage

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
class SpecPlan(Plan):
    """Everything the stages need to build their commands."""

    measure_flags: tuple[str, ...]
    draft_overrides: dict  # the draft's config.json: the target's, with these keys replaced


def gpu_plan(budgets: dict) -> SpecPlan:
    """Llama-3.1-8B's shapes with dummy bf16 weights on the GPU. Limits sized to the workload
    (8 sequences of 512 + 256 tokens): 6 mixed-step programs and 1 fused-decode program per engine."""
    return SpecPlan(
        smoke=False,
        model=GPU_MODEL,
        weight_flags=GPU_WEIGHT_FLAGS,
        engine_limits=("--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "512"),
        budgets_s={**STAGE_BUDGETS_S, **budgets},
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
    )


def smoke_plan(budgets: dict) -> SpecPlan:
    """The demo model, tiny limits and workloads: the whole run on a CPU."""
    return SpecPlan(
        smoke=True,
        model=DEMO_MODEL_DIR,
        weight_flags=SMOKE_DUMMY_WEIGHT_FLAGS,
        budgets_s={**dict.fromkeys(STAGE_BUDGETS_S, SMOKE_STAGE_BUDGET_S), **budgets},
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
    )


def write_draft_config(plan: SpecPlan, directory: str) -> str:
    """A config.json (no weights: the engine makes dummy ones) of the draft model; its directory."""
    from jaxpaged.config.presets import load_config_dict

    config = {**load_config_dict(plan.model)[1], **plan.draft_overrides}
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return directory


def run_config(stage: Stage) -> None:
    """The stage's engine (its name is its configuration's) measured by `gpu/spec_latency.py`."""
    plan, name = stage.plan, stage.name
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


def plan_info(args, plan: SpecPlan, chosen: list[str]) -> dict:
    values = dict(zip(plan.measure_flags[::2], plan.measure_flags[1::2]))
    return {
        "dtype": "bf16",
        "measure_flags": plan.measure_flags,
        "speculative_configs": {n: SPEC_CONFIGS[n] for n in chosen},
        "draft_overrides": plan.draft_overrides,
        "workload": f"{values['--input-len']}-token prompts (a random {values['--phrase-len']}-token phrase "
        f"repeated), {values['--output-len']} output tokens",
    }


RUN = GpuRun(
    description=__doc__,
    results_name="speculative_gpu_run",
    work_prefix="jaxpaged_spec_gpu_",
    stage_budgets=STAGE_BUDGETS_S,
    gpu_plan=gpu_plan,
    smoke_plan=smoke_plan,
    stage_runners=lambda args: dict.fromkeys(STAGE_BUDGETS_S, run_config),
    summary=SUMMARY,
    plan_info=plan_info,
    stages_help="; without plain there are no ratios",
)


if __name__ == "__main__":
    sys.exit(main(RUN))
