"""Workloads for the throughput model: requests as lengths, and when they arrive (no JAX here).

- `random:IN:OUT`: every request IN prompt and OUT output tokens (vLLM's random dataset with a
  range ratio of 0).
- `clinical`: the clinical-notes extraction shape: one shared instruction prefix (900 tokens), a
  note of ~8K tokens of its own (uniform in 6K-10K, seeded), a ~200-token JSON answer, at most
  40 requests in flight (`CLINICAL_MAX_CONCURRENCY`); `clinical:PREFIX:NOTE:OUT` sets the three.
- `sharegpt`: vLLM's ShareGPT sample; it needs the dataset and the model's tokenizer, so its
  lengths come from the caller (`jaxpaged.bench.throughput_model.sharegpt_requests`).

Arrivals are `jaxpaged bench serve`'s (`serve_client.arrival_times`: gamma gaps, rescaled so the
last request arrives at num_requests / rate), all at 0 for rate inf (and offline).
"""

import dataclasses
import random

import numpy as np

WORKLOADS = ("sharegpt", "random:IN:OUT", "clinical[:PREFIX:NOTE:OUT]")
CLINICAL_PREFIX_LEN = 900
CLINICAL_NOTE_LEN = 8000
CLINICAL_NOTE_SPREAD = 0.25  # notes drawn uniformly from NOTE x (1 -/+ this)
CLINICAL_OUTPUT_LEN = 200
CLINICAL_MAX_CONCURRENCY = 40


@dataclasses.dataclass(frozen=True)
class Request:
    """One request as the model replays it.

    Attributes:
      prompt_len: prompt tokens, the shared prefix included.
      output_len: tokens generated (EOS ignored, as the benchmarks run).
      shared_prefix: leading prompt tokens equal in every request of the workload (the prefix
        cache computes them once); 0: none.
    """

    prompt_len: int
    output_len: int
    shared_prefix: int = 0


@dataclasses.dataclass(frozen=True)
class Workload:
    """Requests and what limits their sending.

    Attributes:
      name: what `--workload` said.
      requests: in sending order.
      max_concurrency: most requests in flight (`bench serve --max-concurrency`); None: no cap.
    """

    name: str
    requests: list[Request]
    max_concurrency: int | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)


def _positive_ints(spec: str, parts: list[str], names: tuple[str, ...]) -> list[int]:
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) != len(names) or min(values) < 1:
        raise ValueError(f"--workload {spec}: give {':'.join(names)} as positive integers")
    return values


def parse_workload(spec: str) -> tuple[str, list[int]]:
    """`("sharegpt" | "random" | "clinical", numbers)` of a `--workload` value.

    Raises:
      ValueError: naming --workload and its forms.
    """
    kind, *parts = spec.split(":")
    if kind == "sharegpt" and not parts:
        return kind, []
    if kind == "random":
        return kind, _positive_ints(spec, parts, ("IN", "OUT"))
    if kind == "clinical":
        if not parts:
            return kind, [CLINICAL_PREFIX_LEN, CLINICAL_NOTE_LEN, CLINICAL_OUTPUT_LEN]
        return kind, _positive_ints(spec, parts, ("PREFIX", "NOTE", "OUT"))
    raise ValueError(f"--workload {spec}: use one of {', '.join(WORKLOADS)}")


def random_workload(num_prompts: int, input_len: int, output_len: int) -> Workload:
    """`num_prompts` requests of `input_len` in, `output_len` out, nothing shared."""
    return Workload(f"random:{input_len}:{output_len}", [Request(input_len, output_len)] * num_prompts)


def clinical_workload(
    num_prompts: int,
    prefix_len: int = CLINICAL_PREFIX_LEN,
    note_len: int = CLINICAL_NOTE_LEN,
    output_len: int = CLINICAL_OUTPUT_LEN,
    seed: int = 0,
    max_concurrency: int | None = CLINICAL_MAX_CONCURRENCY,
) -> Workload:
    """The clinical-notes shape (see the module docstring); note lengths seeded by `seed`."""
    rng = random.Random(seed)
    low, high = int(note_len * (1 - CLINICAL_NOTE_SPREAD)), int(note_len * (1 + CLINICAL_NOTE_SPREAD))
    requests = [
        Request(prefix_len + rng.randint(max(low, 1), high), output_len, prefix_len) for _ in range(num_prompts)
    ]
    return Workload(f"clinical:{prefix_len}:{note_len}:{output_len}", requests, max_concurrency)


def lengths_workload(name: str, lengths: list[tuple[int, int]]) -> Workload:
    """A workload of `(prompt_len, output_len)` pairs, nothing shared (a ShareGPT sample)."""
    return Workload(name, [Request(p, o) for p, o in lengths])


def arrival_times(num_requests: int, request_rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """Seconds after the start at which each request is sent: `jaxpaged bench serve`'s schedule
    (tests/test_plan_throughput.py checks it equals `serve_client.arrival_times`)."""
    if request_rate == float("inf"):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).gamma(
        shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests
    )
    times = np.cumsum(gaps)
    return (times * (num_requests / request_rate) / times[-1]).tolist()
