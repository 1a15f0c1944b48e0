"""Timing a method's calls from outside, for the benchmarks that ask where an engine's time goes."""

import time
from collections.abc import Callable


def time_calls(owner: object, name: str, add: Callable[[float], None]) -> None:
    """Replaces `owner.name` (a class's method, or one object's) with a wrapper that passes the
    seconds of every call, finished or raised, to `add`."""
    method = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            add(time.perf_counter() - start)

    setattr(owner, name, timed)
