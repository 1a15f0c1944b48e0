"""The llguidance backend of an engine: its tokenizer, compiled grammars cached by grammar text
(a bounded LRU), compiled on a thread pool off the engine thread.

A compiled grammar is an `LLMatcher` at its start state; each sequence takes a `deep_copy` of it
(microseconds). llguidance compiles without Python's lock held, so compiling never stalls the
engine's steps.
"""

import collections
import concurrent.futures
import threading

import numpy as np

from jaxpaged.sampling_params import StructuredOutputsParams
from jaxpaged.structured.grammar import grammar_text
from jaxpaged.structured.llg import llguidance

CACHE_SIZE = 256  # compiled grammars kept (LRU)


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
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jaxpaged-grammar")
        # llguidance's view of the tokenizer (about a second for a 128K vocabulary), made off
        # the engine thread too; compilations wait for it.
        self._ll_tokenizer = self._pool.submit(
            lambda: llguidance().hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        )
        self._cache: collections.OrderedDict[str, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> concurrent.futures.Future:
        """The compiled grammar of a constraint (a future of an `LLMatcher` at its start state),
        from the cache or submitted to the compiling threads. Never waits for a compilation.

        Raises:
          ValueError: the grammar's text cannot be built (see `grammar_text`).
        """
        text = grammar_text(params)
        with self._lock:
            future = self._cache.get(text)
            if future is not None:
                self._cache.move_to_end(text)
                return future
            future = self._cache[text] = self._pool.submit(self._compile, text)
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def _compile(self, text: str):
        matcher = llguidance().LLMatcher(self._ll_tokenizer.result(), text, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
