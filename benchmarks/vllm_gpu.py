"""jaxpaged on vLLM's own benchmark, in one device call of at most 9 minutes: the first call any
lent GPU runs (issue 43).

    python -m benchmarks.vllm_gpu --prepare-dataset --prepare-wheels   # first, here (network)
    bash benchmarks/run_gpu.sh vllm "$OUT"                             # on the GPU machine
    python -m benchmarks.vllm_gpu --smoke --out /tmp/smoke             # the whole run on a CPU

Every 8B engine of the run has one configuration, vLLM's limits on a GPU of >= 70 GiB (1,024
sequences, 16,384 batched tokens: `jaxpaged.config.defaults.GPU_BATCH_LIMITS`, the `LLM` class's,
given explicitly so that the server's engine compiles the same programs; vLLM's own server
defaults to 8,192 tokens, later releases 16,384) and a 2,048-token context (every request of
vLLM's ShareGPT sample fits), so each stage after engine_start loads its step programs from the
compilation cache engine_start filled. Stages, most valuable first (`STAGE_BUDGETS_S`):

1. mixed_kernels: a mixed step's attention with every row on the ragged kernel against its
   decode rows on the decode kernel, and decode batches of ShareGPT-like contexts visited longest
   first against in batch order (`benchmarks/mixed_attention_gpu.py`), checked and timed.
2. engine_start: the real engine built cold (the cache filled: the start-up time and program
   count at these limits), then warm.
3. throughput: `jaxpaged bench throughput` on vLLM's ShareGPT sample (1,000 requests in vLLM's
   order, counted with the Llama-3 tokenizer: `--prepare-dataset`), as `vllm bench throughput`.
4. latency: batch-1 TPOT (`jaxpaged bench latency`, 32 in / 128 out).
5. serve: `jaxpaged serve` with the Llama-3 tokenizer and `jaxpaged bench serve` on the ShareGPT
   sample at two request rates, streamed (one token per chunk): TTFT, TPOT, ITL.
6. profile: a few steps of a ShareGPT-shaped run under `jax.profiler` (`gpu/profile_steps.py`),
   the trace packed for the throughput model's calibration.

Outputs as every run script's (`gpu/orchestrate.py`): OUT/summary.md, summary.json, console.txt,
stages.tar.gz, rewritten after every stage.
"""

import dataclasses
import sys

from benchmarks.gpu import gpu_run_stages as stages
from benchmarks.gpu import prepare
from benchmarks.gpu.orchestrate import GpuRun, main
from benchmarks.gpu.plan import DEMO_MODEL_DIR, GPU_MODEL, GPU_WEIGHT_FLAGS, SMOKE_ENGINE_LIMITS, Plan
from benchmarks.gpu.stage import CLI
from benchmarks.gpu.summary import Summary, markdown_head, rounded, step_result
from benchmarks.gpu_run import add_args, prepare_instead  # the same sample, tokenizer and wheels

# vLLM's limits on an H100/H200 (the LLM class's), one configuration for every engine of the run.
VLLM_ENGINE_LIMITS = ("--max-model-len", "2048", "--max-num-seqs", "1024", "--max-num-batched-tokens", "16384")
# Seconds per stage; with the device probe (20 s) they sum to 9 minutes. The 8B engine's cold
# compile at these limits is not measured yet (40-110 s a configuration at 256 / 2,048 on the
# first H100 run, with about half the programs): engine_start has the largest share.
STAGE_BUDGETS_S = {
    "mixed_kernels": 60,
    "engine_start": 150,
    "throughput": 100,
    "latency": 40,
    "serve": 125,
    "profile": 45,
}
SMOKE_STAGE_BUDGET_S = 240


@dataclasses.dataclass(frozen=True)
class VllmRunPlan(Plan):
    """What the stages need to build their commands."""

    mixed_flags: tuple[str, ...]
    latency_flags: tuple[str, ...]
    throughput_flags: tuple[str, ...]  # dataset flags without --dataset-path
    count_with_dataset_tokenizer: bool  # the Llama-3 tokenizer --prepare-dataset put beside the dataset
    compare_transformers: bool
    serve_rates: tuple[str, ...]
    serve_flags: tuple[str, ...]  # bench serve's dataset flags without --dataset-path
    profile_flags: tuple[str, ...]


def gpu_plan(budgets: dict) -> VllmRunPlan:
    """Llama-3.1-8B's shapes with random bf16 weights at vLLM's limits."""
    return VllmRunPlan(
        smoke=False,
        model=GPU_MODEL,
        weight_flags=GPU_WEIGHT_FLAGS,
        engine_limits=VLLM_ENGINE_LIMITS,
        budgets_s={**STAGE_BUDGETS_S, **budgets},
        mixed_flags=(),
        latency_flags=("--batch-size", "1", "--input-len", "32", "--output-len", "128", "--num-iters", "10"),
        throughput_flags=("--dataset-name", "sharegpt", "--disable-shuffle", "--num-prompts", "1000"),
        count_with_dataset_tokenizer=True,
        compare_transformers=False,
        serve_rates=("16", "inf"),
        serve_flags=("--dataset-name", "sharegpt", "--disable-shuffle", "--num-prompts", "500"),
        # prompts still arriving (mixed steps) for the first traced steps, then decodes
        profile_flags=("--num-requests", "1000", "--warm-steps", "6", "--traced-steps", "10"),
    )


def smoke_plan(budgets: dict) -> VllmRunPlan:
    """The demo model, tiny limits and workloads, kernels in interpret mode: the whole run on a CPU."""
    return VllmRunPlan(
        smoke=True,
        model=DEMO_MODEL_DIR,
        weight_flags=(),
        engine_limits=SMOKE_ENGINE_LIMITS,
        budgets_s={**dict.fromkeys(STAGE_BUDGETS_S, SMOKE_STAGE_BUDGET_S), **budgets},
        mixed_flags=("--smoke",),
        latency_flags=("--input-len", "8", "--output-len", "8", "--num-iters-warmup", "1", "--num-iters", "2"),
        throughput_flags=("--dataset-name", "sharegpt", "--disable-shuffle", "--num-prompts", "4", "--output-len", "8"),
        count_with_dataset_tokenizer=False,  # the demo model's vocabulary is not Llama-3's
        compare_transformers=False,
        serve_rates=("16", "inf"),
        serve_flags=("--dataset-name", "sharegpt", "--disable-shuffle", "--num-prompts", "4", "--output-len", "8"),
        profile_flags=(
            "--num-requests",
            "4",
            "--prompt-len",
            "8",
            "--output-len",
            "8",
            "--warm-steps",
            "1",
            "--traced-steps",
            "2",
        ),
    )


def run_mixed_kernels(stage) -> None:
    out = stage.path("mixed_attention.json")
    cmd = [sys.executable, "-m", "benchmarks.mixed_attention_gpu", *stage.plan.mixed_flags, "--out", out]
    stage.step("mixed_attention", cmd, out)


def run_latency(stage) -> None:
    """Batch-1 TPOT in the run's engine configuration (its programs from the shared cache)."""
    out = stage.path("latency_batch1.json")
    flags = stages.engine_flags(stage.plan, stages.shared_cache(stage))
    cmd = [*CLI, "bench", "latency", "--model", stage.plan.model, *stage.plan.latency_flags, *flags]
    stage.step("batch1", [*cmd, "--output-json", out], out)


def run_serve(stage, dataset_path: str) -> None:
    """`jaxpaged serve` (the tokenizer of the dataset's counts: it takes text) and `bench serve`
    on the ShareGPT sample at each rate; streamed, as vLLM's bench serve streams."""
    out, results = stage.path("serve_result.json"), stage.path("serve_results")
    dataset = ["--dataset-path", dataset_path]
    tokenizer = []
    if stage.plan.count_with_dataset_tokenizer:
        tokenizer = ["--tokenizer", prepare.dataset_tokenizer_path(dataset_path)]
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu.serve_load",
        "--model",
        stage.plan.model,
        "--result-dir",
        results,
        "--output-json",
        out,
        "--rates",
        ",".join(stage.plan.serve_rates),
        "--bench-flags",
        " ".join([*stage.plan.serve_flags, *dataset, *tokenizer]),
        "--",
        *stages.engine_flags(stage.plan, stages.shared_cache(stage)),
        *tokenizer,
    ]
    stage.step("two_rates", cmd, out)


def run_profile(stage) -> None:
    out, trace = stage.path("profile_steps.json"), stage.path("profile_trace")
    flags = stages.engine_flags(stage.plan, stages.shared_cache(stage))
    cmd = [sys.executable, "-m", "benchmarks.gpu.profile_steps", "--model", stage.plan.model, *flags]
    stage.step("traced_steps", [*cmd, *stage.plan.profile_flags, "--trace-dir", trace, "--output-json", out], out)


def stage_runners(args) -> dict:
    return {
        "mixed_kernels": run_mixed_kernels,
        "engine_start": stages.run_engine_start,
        "throughput": lambda stage: stages.run_throughput(stage, args.dataset_path),
        "latency": run_latency,
        "serve": lambda stage: run_serve(stage, args.dataset_path),
        "profile": run_profile,
    }


def headline(record: dict, records: list[dict]) -> dict:
    name = record["stage"]
    if name == "mixed_kernels":
        rows = (step_result(record) or {}).get("mixed", [])
        return {
            r[
                "case"
            ]: f"{r['speedup']:.2f}x ({r['ragged_only_s'] * 1e6:.0f} -> {r['decode_plus_ragged_s'] * 1e6:.0f} us)"
            for r in rows
        }
    if name == "engine_start":
        cold, warm = step_result(record, "cold") or {}, step_result(record, "warm") or {}
        return {"cold_ready_s": cold.get("ready_s"), "warm_ready_s": warm.get("ready_s")}
    if name == "throughput":
        result = step_result(record, "jaxpaged_only") or {}
        return {
            "requests": result.get("num_requests"),
            "output_tok_s": rounded(result.get("output_tokens_per_second"), 0),
            "total_tok_s": rounded(result.get("tokens_per_second"), 0),
            "prompt_tokens": result["total_num_tokens"] - result["total_output_tokens"] if result else None,
            "output_tokens": result.get("total_output_tokens"),
        }
    if name == "latency":
        result = step_result(record, "batch1") or {}
        return {"tpot_ms": rounded(result.get("avg_time_per_output_token_ms"))}
    if name == "serve":
        runs = (step_result(record, "two_rates") or {}).get("runs", [])
        return {
            f"rate {r['request_rate']}": f"{r['output_throughput']:.0f} tok/s, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
            f"TPOT p50 {r['median_tpot_ms']:.1f} ms, ITL p50 {r['median_itl_ms']:.1f} ms"
            for r in runs
        }
    result = step_result(record, "traced_steps") or {}
    return {"steps": len(result.get("steps", [])), "trace_bytes": result.get("trace_bytes")}


def markdown(device: dict, records: list[dict], plan: dict) -> str:
    def cell(record: dict) -> str:
        return "; ".join(f"{k} {v}" for k, v in record.get("headline", {}).items() if v is not None)

    return "\n".join(markdown_head("vLLM's benchmark", device, records, "headline", cell)) + "\n"


RUN = GpuRun(
    description=__doc__,
    results_name="vllm_gpu",
    work_prefix="jaxpaged_vllm_gpu_",
    stage_budgets=STAGE_BUDGETS_S,
    gpu_plan=gpu_plan,
    smoke_plan=smoke_plan,
    stage_runners=stage_runners,
    summary=Summary(headline, markdown),
    add_args=add_args,
    before_run=prepare_instead,
)


if __name__ == "__main__":
    sys.exit(main(RUN))
