"""Engines shared by the whole test session.

Building an engine traces, lowers and compiles its step programs (a few seconds each time, even
with the compilation cache warm), so the tests use a few canonical configurations (CANONICAL)
rather than one of their own each, and borrow the engine of one from the `shared_engines`
fixture (tests/conftest.py) instead of building it again:

    def test_x(shared_engines):
        llm = shared_engines.get("tiny")  # an `LLM`, built on first use

A borrower leaves the engine as it found it: nothing running or waiting, no option or method
changed. A test that must end it (a server whose shutdown closes the engine's grammar workers)
`take`s it instead: it leaves the pool, and the next borrower gets a new one. At most
MAX_ALIVE engines are alive at once; building another drops the least recently used.

Engines of other configurations share compiled programs with these through the compilation
cache when their shapes agree, so a test that needs an option of its own (a small pool to
preempt, another model) keeps the canonical sizes where it can.
"""

import collections
import gc
from collections.abc import Callable

from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR

MAX_ALIVE = 2

# name -> the `LLM` options of the canonical configuration; "tiny" runs the tiny random Llama
# of tests/engine_fixtures.py (GQA 4, a 512-token vocabulary) that `tiny_model` saves once.
CANONICAL = {
    "tiny": dict(dtype="float32", max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64),
    "demo": dict(model=DEMO_MODEL_DIR, dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64),
    # the shared demo server's engine (tests/demo_server.py): demo's shapes, one decode step per program
    "demo-server": dict(
        model=DEMO_MODEL_DIR,
        dtype="float32",
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        num_scheduler_steps=1,
    ),
}


class SharedEngines:
    """The session's canonical engines, at most MAX_ALIVE alive, the least recently used dropped
    first."""

    def __init__(self, tiny_model_dir: Callable[[], str]):
        self._models = {"tiny": tiny_model_dir}  # saved on first use: "demo" needs no torch
        self._alive: collections.OrderedDict = collections.OrderedDict()

    def get(self, name: str):
        """The shared engine of configuration `name` (built now if none is alive)."""
        if name in self._alive:
            self._alive.move_to_end(name)
            return self._alive[name]
        while len(self._alive) >= MAX_ALIVE:
            self._alive.popitem(last=False)
            gc.collect()  # its arrays and compiled programs go now, not at some later collection
        self._alive[name] = self._build(name)
        return self._alive[name]

    def take(self, name: str):
        """The engine of configuration `name`, now the caller's alone (it leaves the pool)."""
        llm = self.get(name)
        del self._alive[name]
        return llm

    def close(self) -> None:
        self._alive.clear()
        gc.collect()

    def _build(self, name: str):
        from jaxpaged.entrypoints.llm import LLM

        if name not in CANONICAL:
            raise KeyError(f"no canonical engine {name!r}: one of {sorted(CANONICAL)}")
        options = dict(CANONICAL[name])
        model = options.pop("model", None) or self._models[name]()
        return LLM(model, **options)
