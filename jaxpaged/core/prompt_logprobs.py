"""A request's prompt logprobs as its prefill chunks bring them back (host only, numpy, no JAX).

Entry j describes prompt token j + 1 (the first prompt token has none: nothing precedes it).
A chunk's step computes the entries of the tokens after its own; a sequence preempted by
recompute computes some again, which just overwrites them.
"""

import dataclasses

import numpy as np


@dataclasses.dataclass
class PromptLogprobs:
    """Per prompt token after the first: its logprob and rank, and the top-k alternatives.

    Attributes:
      logprobs: `[P - 1]` float32.
      ranks: `[P - 1]` int32 (1 = likeliest).
      top_ids: `[P - 1, k]` int32.
      top_logprobs: `[P - 1, k]` float32.
      filled: `[P - 1]` which entries a step has brought back.
    """

    logprobs: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    filled: np.ndarray

    @classmethod
    def empty(cls, prompt_len: int, k: int) -> "PromptLogprobs":
        n = max(prompt_len - 1, 0)
        return cls(
            logprobs=np.zeros(n, np.float32),
            ranks=np.zeros(n, np.int32),
            top_ids=np.zeros((n, k), np.int32),
            top_logprobs=np.zeros((n, k), np.float32),
            filled=np.zeros(n, bool),
        )

    @property
    def complete(self) -> bool:
        return bool(self.filled.all())

    def record(self, first: int, logprobs, ranks, top_ids, top_logprobs) -> None:
        """Keeps a chunk's entries for prompt tokens `first ..` (`first` >= 1; top-L arrays are
        cut to k)."""
        rows = slice(first - 1, first - 1 + len(logprobs))
        k = self.top_ids.shape[1]
        self.logprobs[rows] = logprobs
        self.ranks[rows] = ranks
        self.top_ids[rows] = np.asarray(top_ids)[:, :k]
        self.top_logprobs[rows] = np.asarray(top_logprobs)[:, :k]
        self.filled[rows] = True
