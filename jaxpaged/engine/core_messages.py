"""What the server and the engine-core process (`core_process.py`) say to each other over their
pipe: small pickled dataclasses (no JAX). Commands go to the core; the core answers once per step
with a `CoreStep` (batched: the step's deltas, the adds it accepted or refused, its stats)."""

import dataclasses
from typing import Any

from jaxpaged.core.seq_delta import SeqDelta
from jaxpaged.engine_config import EngineConfig
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
class CoreStep:
    """One step's news: the adds answered before it, its deltas, and the stats after it."""

    added: list[AddResult]
    deltas: list[SeqDelta]
    stats: dict[str, Any]


@dataclasses.dataclass
class CoreStopped:
    """The core has shut down (after `Shutdown`); its last stats."""

    stats: dict[str, Any]
