"""The server's check of a request's grammar before it reaches the engine: on threads of its own
(not the event loop, not the tokenizer threads), at the lowest CPU priority, under a size and a
time budget, with the verdicts of recent constraints cached.

- Over `--max-grammar-bytes` (`jaxpaged.structured.grammar.constraint_bytes`): a 400 naming the
  flag, before any work.
- Checked (llguidance, no tokenizer) for at most `--grammar-check-timeout` seconds: a check still
  running then is a 400 naming the flag (the check itself runs on to its end: llguidance cannot be
  interrupted, but the size budget bounds it, and its thread yields the CPU to the engine); a
  check that did not even start by then (the threads busy with others) is a 503 with Retry-After.
- The same constraint again (by its fields' text) gets the cached verdict without a check.
"""

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import threading

from jaxpaged.sampling_params import StructuredOutputsParams
from jaxpaged.server.async_engine import EngineOverloadedError
from jaxpaged.server.errors import APIError
from jaxpaged.structured.backend import lower_thread_priority
from jaxpaged.structured.grammar import check

CACHE_SIZE = 1024  # verdicts kept (LRU)


class GrammarChecks:
    """Checks constraints for one server.

    Args:
      max_bytes: `--max-grammar-bytes`.
      timeout: `--grammar-check-timeout`, seconds.
      threads: checking threads.
    """

    def __init__(self, max_bytes: int, timeout: float, threads: int = 2):
        self.max_bytes, self.timeout = max_bytes, timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(
            threads, thread_name_prefix="jaxpaged-grammar-check", initializer=lower_thread_priority
        )
        self._verdicts: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.checked = 0  # constraints checked (the others came from the cache)
        self.cache_hits = 0

    async def check(self, params: StructuredOutputsParams, field: str) -> None:
        """400 naming `field` when the constraint is over budget or cannot be compiled; 503 when
        the checking threads stayed busy for the whole time budget."""
        future = self._pool.submit(self._verdict, params)
        try:
            error = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout)
        except TimeoutError:
            if future.cancel():  # never started: the threads were busy with other checks
                raise EngineOverloadedError("the server's grammar checks are busy; retry shortly") from None
            raise APIError(
                f"{field}: checking this constraint took longer than {self.timeout:g} s "
                "(--grammar-check-timeout): simplify it",
                param=field,
            ) from None
        if error is not None:
            raise APIError(f"{field}: {error}", param=field)

    def _verdict(self, params: StructuredOutputsParams) -> str | None:
        """`check`'s message (None: it compiles), cached by the constraint's text; on a checking
        thread."""
        try:
            key = json.dumps(dataclasses.asdict(params), sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            key = None
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                self.cache_hits += 1
                return self._verdicts[key]
        try:
            check(params, self.max_bytes)
            error = None
        except ValueError as err:
            error = str(err)
        with self._lock:
            self.checked += 1
            if key is not None:
                self._verdicts[key] = error
                while len(self._verdicts) > CACHE_SIZE:
                    self._verdicts.popitem(last=False)
        return error
