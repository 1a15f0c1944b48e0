"""What every GPU run's plan shares: the paths, the engine limits and weight flags more than one run
uses, the XLA flags, and the fields every plan has. Each run's own plan (its models, workloads and
stage budgets) is a subclass of `Plan` in its script; every number a run depends on is a constant
there or here."""

import dataclasses
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO_MODEL_DIR = os.path.join(ROOT, "jaxpaged", "demo_model")

# The device probe's time; with the stages' budgets it stays inside 9.5 minutes of a 10-minute call.
PROBE_TIMEOUT_S = 20

# Llama-3.1-8B's shapes with random bf16 weights: what every run measures on the GPU.
GPU_MODEL = "llama-3.1-8b"
GPU_WEIGHT_FLAGS = ("--dtype", "bfloat16", "--load-format", "dummy")
# One set of engine limits for every 8B engine of gpu_run.py (latency, throughput, serving and the
# start-up measurements), so that their step programs are the same and the later stages load them
# from the compilation cache that engine_start filled; quantization_gpu.py's bf16 engine compiles
# the same programs. 2048 tokens hold any ShareGPT pair vLLM's filter keeps.
GPU_ENGINE_LIMITS = ("--max-model-len", "2048", "--max-num-seqs", "256", "--max-num-batched-tokens", "2048")
# The smoke runs' engines compile three programs (one token bucket) instead of a dozen.
SMOKE_ENGINE_LIMITS = (
    "--max-model-len",
    "128",
    "--max-num-seqs",
    "1",
    "--max-num-batched-tokens",
    "16",
    "--num-scheduler-steps",
    "1",
)
# The demo model's shapes with dummy weights (no tokenizer: the prompts are token ids).
SMOKE_DUMMY_WEIGHT_FLAGS = ("--dtype", "bfloat16", "--load-format", "dummy", "--skip-tokenizer-init")
# The smoke runs' numbers mean nothing: XLA's CPU compiler may skip its slow optimisations (~40%
# of each compile on the 2-core CI machine).
SMOKE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
# XLA's flags under which a scanned step reads each layer's weights out of the stacked array in
# place: dynamic-slice fusion, which feeds cuBLAS GEMMs only (with Triton GEMMs, XLA's default,
# every layer's slice is copied first: tests/gpu_compile/test_h100_programs.py).
SCANNED_IN_PLACE = "--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_enable_triton_gemm=false"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What every run's stages need to build their commands; a run's plan adds its own fields."""

    smoke: bool
    model: str
    weight_flags: tuple[str, ...]  # dtype and load format
    engine_limits: tuple[str, ...]
    budgets_s: dict  # stage name -> seconds, in the run's order

    def info(self, chosen: list[str]) -> dict:
        """summary.json's plan: what every run reports, with the budgets of the `chosen` stages."""
        return {
            "smoke": self.smoke,
            "model": self.model,
            "engine_limits": self.engine_limits,
            "budgets_s": {name: self.budgets_s[name] for name in chosen},
        }
