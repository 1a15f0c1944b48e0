"""jaxpaged: PagedAttention LLM inference in pure JAX/Pallas.

Offline use follows vLLM::

    from jaxpaged import LLM, SamplingParams
    llm = LLM("path/to/model")          # or LLM() / LLM("demo"): the tiny demo model in the package
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.8, max_tokens=64))

`jaxpaged.functional.step` is the engine's pure step function, for use inside your own JAX code.
Names are imported lazily, so the host-only modules (scheduler, block manager, ...) load
without JAX.
"""

import importlib
import os

# JAX's allocator takes XLA_PYTHON_CLIENT_MEM_FRACTION of GPU memory (75% by default) in one
# region at start-up; the engine sizes its KV cache from that limit itself (gpu_memory_utilization),
# so the limit is raised to 95%. The region stays preallocated: an allocator grown on demand
# (XLA_PYTHON_CLIENT_PREALLOCATE=false) fragments, and on the first H100 run an 8B engine whose
# weights and pool fit with 4 GiB to spare could not allocate a 27 GiB half of its pool.
# Takes effect when jaxpaged is imported before JAX initialises its GPU backend (set the
# variables yourself otherwise).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
# transformers is the tokenizer here: its advisory warnings ("PyTorch was not found. Models won't
# be available ...") are noise to a jaxpaged user (its real warnings and errors still show).
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

_EXPORTS = {
    "LLM": "jaxpaged.entrypoints.llm",
    "LLMEngine": "jaxpaged.engine.llm_engine",
    "EngineArgs": "jaxpaged.engine_args",
    "ModelConfig": "jaxpaged.config.model_config",
    "SamplingParams": "jaxpaged.sampling_params",
    "LoRARequest": "jaxpaged.lora_request",
    "RequestOutputKind": "jaxpaged.sampling_params",
    "StructuredOutputsParams": "jaxpaged.sampling_params",
    "RequestOutput": "jaxpaged.outputs",
    "CompletionOutput": "jaxpaged.outputs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxpaged' has no attribute {name!r}")
