"""The llguidance backend of an engine: its tokenizer, and grammars built from a request's
constraint and compiled on their own threads, cached by grammar text (a bounded LRU).

All of a grammar's work (its text from the schema, the compile, the first mask) runs on those
threads, never on the engine's: llguidance works without Python's lock held, and the threads
run at the lowest CPU priority (`os.setpriority`, Linux), so a grammar that takes seconds to
compile delays only its own request; the engine schedules a request once its grammar is ready.

A compiled grammar is an `LLMatcher` at its start state; each sequence takes a `deep_copy` of it
(microseconds). A grammar that fails to compile, or that allows no output at all (a `$ref`
cycle, an empty language), fails its request with llguidance's reason.
"""

import bisect
import collections
import concurrent.futures
import os
import threading
import time

import numpy as np

from jaxpaged.sampling_params import StructuredOutputsParams
from jaxpaged.structured.grammar import digest, grammar_text, parser_limits
from jaxpaged.structured.llg import llguidance

CACHE_SIZE = 256  # compiled grammars kept (LRU)
# Upper bounds (s) of the compile-time histogram's buckets (`GrammarBackend.compile_seconds`).
COMPILE_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOWEST_PRIORITY = 19  # the grammar threads' niceness


def lower_thread_priority() -> None:
    """Runs the calling thread at the lowest CPU priority (Linux: threads have their own
    niceness; elsewhere nothing changes)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWEST_PRIORITY)
    except (AttributeError, OSError):
        pass


def tokenizer_mask(tokenizer_size: int, vocab_size: int) -> np.ndarray:
    """`[ceil(V / 32)]` int32 bits of the ids a tokenizer can produce: a model's vocabulary may be
    larger than its tokenizer's (padded embeddings), and those ids are never allowed."""
    allowed = np.arange(32 * -(-vocab_size // 32)) < min(tokenizer_size, vocab_size)
    return pack_bits(allowed[None])[0]


def pack_bits(allowed: np.ndarray) -> np.ndarray:
    """`[N, 32 * W]` bools into `[N, W]` int32 words, token i in bit `i % 32` of word `i // 32`
    (llguidance's layout)."""
    bits = allowed.reshape(allowed.shape[0], -1, 32).astype(np.uint32) << np.arange(32, dtype=np.uint32)
    return bits.sum(axis=-1, dtype=np.uint32).view(np.int32)


class GrammarBackend:
    """Compiles and caches grammars for one engine.

    Args:
      tokenizer: the engine's Hugging Face (fast) tokenizer.
      vocab_size: V, the model's vocabulary (at least the tokenizer's).
      eos_token_ids: the engine's EOS ids (Llama 3 has several): each is allowed exactly when the
        grammar accepts.
      threads: compiling threads.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, threads: int = 2):
        eos = sorted(eos_token_ids) or [tokenizer.eos_token_id]
        self.vocab_size = vocab_size
        self.valid_ids = tokenizer_mask(len(tokenizer), vocab_size)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="jaxpaged-grammar", initializer=lower_thread_priority
        )
        # llguidance's view of the tokenizer (about a second for a 128K vocabulary), made off
        # the engine thread too; compilations wait for it.
        self._ll_tokenizer = self._pool.submit(
            lambda: llguidance().hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        )
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (the others came from the cache)
        self.cache_hits = 0
        # compiles (failed ones too) by seconds taken: bucket i counts those of at most
        # COMPILE_SECONDS_BUCKETS[i] and above the one before; the last, those above them all
        self.compile_seconds = [0] * (len(COMPILE_SECONDS_BUCKETS) + 1)
        self.compile_seconds_sum = 0.0

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar of a constraint: a future of an `LLMatcher` at its start state,
        or of the `ValueError` (`structured_outputs.<kind>: ...`) saying why there is none. Returns
        at once: the grammar's text is built on the compiling threads too."""
        return self._pool.submit(self._compiled, params)

    def _compiled(self, params: StructuredOutputsParams):
        text = grammar_text(params)
        with self._lock:
            future = self._cache.get(text)
            mine = future is None
            if mine:
                future = self._cache[text] = concurrent.futures.Future()
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
                self.compiles += 1
            else:
                self._cache.move_to_end(text)
                self.cache_hits += 1
        if mine:
            began = time.perf_counter()
            try:
                future.set_result(self._compile(params.kind, text))
            except Exception as err:  # noqa: BLE001 - the request's error, cached like a grammar
                future.set_exception(err)
            seconds = time.perf_counter() - began
            with self._lock:
                self.compile_seconds[bisect.bisect_left(COMPILE_SECONDS_BUCKETS, seconds)] += 1
                self.compile_seconds_sum += seconds
        return future.result()  # another thread's compile of the same text: waits for it

    def _compile(self, kind: str, text: str):
        try:
            matcher = llguidance().LLMatcher(self._ll_tokenizer.result(), text, log_level=0, limits=parser_limits())
        except BaseException as err:  # llguidance raises a PanicException (a BaseException) on its own bugs
            raise ValueError(f"structured_outputs.{kind}: the grammar failed to compile: {digest(str(err))}") from None
        if not matcher.is_error():  # the first mask: a grammar that allows nothing fails here
            row = np.zeros((1, self.valid_ids.size), np.int32)
            llguidance().numpy.fill_next_token_bitmask(matcher, row, 0)
            if matcher.is_error() or not (row & self.valid_ids).any():  # e.g. a `$ref` cycle
                why = f" (llguidance: {digest(matcher.get_error())})" if matcher.is_error() else ""
                raise ValueError(
                    f"structured_outputs.{kind}: the grammar allows no output: no first token can start a "
                    f"document it accepts (a `$ref` cycle or an empty language?){why}"
                )
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{kind}: {digest(matcher.get_error())}")
        return matcher

    def stats(self) -> dict:
        """Counters for the engine's stats: compiles, cache hits, and the compile-time histogram
        (`(bucket upper bounds, counts per bucket, sum of seconds)`)."""
        with self._lock:
            histogram = (COMPILE_SECONDS_BUCKETS, tuple(self.compile_seconds), self.compile_seconds_sum)
            return {
                "grammar_compiles": self.compiles,
                "grammar_cache_hits": self.cache_hits,
                "grammar_compile_seconds": histogram,
            }

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
