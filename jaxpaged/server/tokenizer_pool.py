"""Tokenization and detokenization on worker threads, off the event loop.

A 4 MiB prompt takes seconds to tokenize; on the event loop it would stall every other client
(`/health` included). The Rust tokenizer releases the GIL while it works, so threads suffice.
Each worker loads its own tokenizer: one Hugging Face tokenizer object shared by threads can
fail ("Already borrowed") when calls change its truncation settings concurrently.
"""

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any


class TokenizerPool:
    """`size` threads, each with its own tokenizer from `tokenizer_dir`.

    Attributes:
      max_token_chars: characters of the longest vocabulary entry: a text longer than
        `n * max_token_chars` has more than `n` tokens, which bounds a prompt before tokenizing.
    """

    def __init__(self, tokenizer_dir: str, size: int):
        self.tokenizer_dir = tokenizer_dir
        self._executor = concurrent.futures.ThreadPoolExecutor(max(1, size), thread_name_prefix="jaxpaged-tokenizer")
        self._local = threading.local()
        self.max_token_chars = self._executor.submit(
            lambda: max(len(t) for t in self._tokenizer().get_vocab())
        ).result()

    def _tokenizer(self):
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = self._local.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        return tokenizer

    async def run(self, fn: Callable[..., Any], *args) -> Any:
        """`fn(tokenizer, *args)` on a worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(self._tokenizer(), *args))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
