"""jaxpaged: PagedAttention LLM inference in pure JAX/Pallas.

Offline use follows vLLM::

    from jaxpaged import LLM, SamplingParams
    llm = LLM("path/to/model")
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0.8, max_tokens=64))

`jaxpaged.functional.step` is the engine's pure step function, for use inside your own JAX code.
"""

import os

# JAX would otherwise grab 75% of GPU memory at start-up and cap itself there; the engine sizes
# its KV cache from the device's memory itself (gpu_memory_utilization), so let the allocator
# grow on demand up to 95%. Takes effect when jaxpaged is imported before JAX initialises its
# GPU backend (set the variables yourself otherwise).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

from jaxpaged.config import ModelConfig  # noqa: E402
from jaxpaged.engine import LLMEngine  # noqa: E402
from jaxpaged.engine_args import EngineArgs  # noqa: E402
from jaxpaged.llm import LLM  # noqa: E402
from jaxpaged.outputs import CompletionOutput, RequestOutput  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "LLMEngine", "ModelConfig", "RequestOutput", "SamplingParams"]
