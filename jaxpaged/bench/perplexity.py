"""Perplexity of held-out text through the paged pool: how much a quantization mode costs.

The text is the demo model's held-out King James verses (`data/kjv_heldout_verses.txt`: every
50th verse of the Authorized Version, the ones its training never saw; public domain). Each
verse is encoded as the model was trained on it (`BOS verse EOS`), the verses are joined into
one token stream, and the stream is cut into windows; every window is prefilled through the pool
(`PagedGenerator.prompt_logits`), so the logits come from K/V read back from the pool in its
dtype, and each token after the window's first is scored.

    perplexity = exp(mean over scored tokens of -log p(token | the window before it))
"""

import os

import numpy as np

HELDOUT_FILE = os.path.join(os.path.dirname(__file__), "data", "kjv_heldout_verses.txt")


def heldout_token_windows(tokenizer, window: int, max_windows: int | None = None) -> list[list[int]]:
    """The held-out verses as `BOS verse EOS` token ids, joined and cut into windows of `window`
    tokens (a last partial window is dropped), at most `max_windows` of them."""
    with open(HELDOUT_FILE, encoding="utf-8") as f:
        verses = [line.strip() for line in f if line.strip()]
    stream: list[int] = []
    for verse in verses:
        stream += tokenizer.encode(verse) + [tokenizer.eos_token_id]  # encode() prepends BOS
        if max_windows is not None and len(stream) >= max_windows * window:
            break
    count = len(stream) // window if max_windows is None else min(len(stream) // window, max_windows)
    return [stream[i * window : (i + 1) * window] for i in range(count)]


def negative_log_likelihoods(logits: np.ndarray, tokens: list[int]) -> np.ndarray:
    """`-log p(tokens[i + 1])` from the float32 logits `[n, V]` of positions `0 .. n - 1`."""
    logits = logits[:-1].astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    return -log_probs[np.arange(len(tokens) - 1), tokens[1:]]


def perplexity(generator, windows: list[list[int]]) -> float:
    """Perplexity of `windows` under a `PagedGenerator` (each window prefilled in one step)."""
    nll = np.concatenate([negative_log_likelihoods(generator.prompt_logits(w), w) for w in windows])
    return float(np.exp(nll.mean()))
