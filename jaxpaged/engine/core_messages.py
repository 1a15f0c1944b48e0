"""What the server and the engine-core process (`core_process.py`) say to each other over their
pipe: small pickled dataclasses (no JAX). Commands go to the core; the core answers once per step
with a `CoreStep` (batched: the step's deltas, the adds and controls it answered, its stats)."""

import dataclasses
from typing import Any

from jaxpaged.core.seq_delta import SeqDelta
from jaxpaged.engine_config import EngineConfig
from jaxpaged.lora_request import LoRARequest
from jaxpaged.sampling_params import SamplingParams

# -- server -> core ---------------------------------------------------------------------------


@dataclasses.dataclass
class AddRequests:
    """Add requests, all or none (`LLMEngine.add_sequences`); answered by an `AddResult`."""

    tag: int
    request_ids: list[str]
    prompts: list[Any]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    lora_request: LoRARequest | None = None


@dataclasses.dataclass
class Abort:
    """Abort these requests (None: every unfinished one)."""

    request_ids: list[str] | None


@dataclasses.dataclass
class StopOnString:
    """The server found a stop string (`LLMEngine.stop_on_string`)."""

    request_id: str
    index: int
    num_output_tokens: int
    stop: str


# The training-loop controls (`engine/training_loop.py`) the server may call by the development-
# mode routes, and the profiler's (`engine/profiling.py`): on the engine's thread or in the
# engine-core process, always between two steps.
CONTROL_METHODS = (
    "sleep",
    "wake_up",
    "is_sleeping",
    "reset_prefix_cache",
    "pause_generation",
    "resume_generation",
    "is_paused",
    "start_profile",
    "stop_profile",
    "add_lora",
    "remove_lora",
)


@dataclasses.dataclass
class Control:
    """Call `engine.<method>(*args)`, one of `CONTROL_METHODS`; answered by a `ControlResult`.

    Raises:
      ValueError: `method` is not one of `CONTROL_METHODS`.
    """

    tag: int
    method: str
    args: tuple

    def __post_init__(self):
        if self.method not in CONTROL_METHODS:
            raise ValueError(f"engine control {self.method!r} must be one of {CONTROL_METHODS}")

    def run(self, engine) -> "ControlResult":
        """Calls the method on `engine` (an `LLMEngine`); its error (e.g. sleep with requests
        running) is the answer, never raised: the engine goes on."""
        try:
            return ControlResult(self.tag, getattr(engine, self.method)(*self.args))
        except Exception as err:
            return ControlResult(self.tag, None, err)


@dataclasses.dataclass
class Shutdown:
    """Abort what is left, step until idle, release the engine and exit."""


# -- core -> server ---------------------------------------------------------------------------


@dataclasses.dataclass
class CoreChecked:
    """The child's devices and memory fit the engine (`check_engine_fits`); building begins."""


@dataclasses.dataclass
class CoreReady:
    """The engine is built: its resolved config (its tokenizer's directory included), its stats."""

    config: EngineConfig
    stats: dict[str, Any]


@dataclasses.dataclass
class CoreFailed:
    """The engine failed to start (`starting`) or a step raised; the process exits."""

    error: BaseException
    starting: bool


@dataclasses.dataclass
class AddResult:
    """One `AddRequests`' answer: `(request id, prompt text, prompt token ids, resolved params)`
    per request, or the error that refused them all."""

    tag: int
    accepted: list[tuple[str, str | None, list[int], SamplingParams]]
    error: BaseException | None = None


@dataclasses.dataclass
class ControlResult:
    """One `Control`'s answer: what the method returned, or the error it raised."""

    tag: int
    result: Any
    error: BaseException | None = None


@dataclasses.dataclass
class CoreStep:
    """One step's news: the adds and controls answered before it (in the order they came), its
    deltas, and the stats after it."""

    answers: list[AddResult | ControlResult]
    deltas: list[SeqDelta]
    stats: dict[str, Any]


@dataclasses.dataclass
class CoreStopped:
    """The core has shut down (after `Shutdown`); its last stats."""

    stats: dict[str, Any]
