"""`jaxpaged generate`: offline batch generation from the command line.

1. Read the prompts (arguments, or a JSONL file whose lines may carry their own sampling
   options) and check every flag — before JAX is imported.
2. Tokenize (the model's chat template for `messages` lines), size the engine to the job
   (sequences, batched tokens, context) and check every prompt fits — before compiling.
3. Start the engine (its start-up logs each stage) and generate; print or write JSONL.
"""

import argparse
import dataclasses
import json
import logging
import re
import sys

from jaxpaged.checkpoint.format import tokenizer_dir
from jaxpaged.config import defaults
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.engine_args import compatibility_notes
from jaxpaged.engine_config import EngineConfig
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR, engine_config, engine_options
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger("jaxpaged")

PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")
# SamplingParams fields a JSONL line may set; the rest are not offered here.
LINE_OPTIONS = tuple(
    f.name for f in dataclasses.fields(SamplingParams) if f.name not in ("n", "logprobs", "output_kind")
)


def add_generate_flags(parser: argparse.ArgumentParser) -> None:
    """The sampling flags of `generate` (defaults for every prompt; JSONL lines may override)."""
    parser.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to complete (or use --input)")
    parser.add_argument(
        "--input",
        metavar="FILE",
        help="JSONL file: per line a 'prompt', 'prompt_token_ids' or "
        f"'messages' field, optionally with sampling options ({', '.join(LINE_OPTIONS)})",
    )
    parser.add_argument("--output", metavar="FILE", help="write JSONL results here instead of printing")
    # Unset sampling flags take the model's generation_config.json (--generation-config), else
    # SamplingParams' defaults: what LLM.generate and the server use too.
    model_default = "(default: the model's generation_config.json, else {})"
    parser.add_argument("--max-tokens", type=int, help="tokens to generate per prompt " + model_default.format(16))
    parser.add_argument("--temperature", type=float, help="0 for greedy " + model_default.format(1.0))
    parser.add_argument("--top-p", type=float, help="nucleus sampling; 1 is off " + model_default.format(1.0))
    parser.add_argument("--top-k", type=int, help="0 is off " + model_default.format(0))
    parser.add_argument(
        "--sampling-seed", type=int, default=None, help="seed of every request (default: each draws one from --seed)"
    )
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def read_items(args: argparse.Namespace) -> list[dict]:
    """The prompts as JSONL-style items, each checked (prompt field and sampling options)."""
    if bool(args.prompts) == bool(args.input):
        raise ValueError("give either PROMPT arguments or --input FILE.jsonl")
    if args.prompts:
        return [{"prompt": p} for p in args.prompts]
    items = []
    with open(args.input) as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                items.append(_parse_line(f"{args.input}:{line_no}", line))
    if not items:
        raise ValueError(f"{args.input} holds no prompts")
    return items


def _parse_line(where: str, line: str) -> dict:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(item, dict):
        raise ValueError(f"{where}: each line must be a JSON object")
    present = [k for k in PROMPT_KEYS if k in item]
    if len(present) != 1:
        raise ValueError(f"{where}: each line needs exactly one of {', '.join(PROMPT_KEYS)} (got {present or 'none'})")
    unknown = sorted(set(item) - set(PROMPT_KEYS) - set(LINE_OPTIONS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; a line may set {', '.join(LINE_OPTIONS)}")
    item["_where"] = where
    return item


def sampling_params(args: argparse.Namespace, item: dict, defaults: dict | None = None) -> SamplingParams:
    """The item's own sampling options, else the flags', else `defaults` (the model's generation
    config: `EngineConfig.load.sampling_defaults`), else `SamplingParams`' own."""
    flags = dict(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        stop=args.stop or None,
        ignore_eos=args.ignore_eos,
    )
    options = dict(defaults or {})
    options.update({k: v for k, v in flags.items() if v is not None})
    options.update({k: v for k, v in item.items() if k in LINE_OPTIONS})
    try:
        return SamplingParams(**options)
    except ValueError as err:
        if "_where" not in item:
            raise
        text = str(err)
        own = re.match(r"SamplingParams\.(\w+)", text)
        if own and own.group(1) in item:  # the line's own field, not the flag's value
            text = f'field "{own.group(1)}"{text[own.end() :]}'
        raise ValueError(f"{item['_where']}: {text}") from None


def tokenize(items: list[dict], tokenizer) -> list[dict]:
    """Engine prompts (`prompt_token_ids`, plus the text when there is one) for every item."""
    prompts = []
    for i, item in enumerate(items):
        where = item.get("_where", f"prompt {i + 1}")
        if "prompt_token_ids" in item:
            ids = item["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError(f"{where}: prompt_token_ids must be a list of integers")
            prompts.append({"prompt_token_ids": ids})
            continue
        if tokenizer is None:
            raise ValueError(
                f"{where}: the model directory has no tokenizer, so prompts must be token ids "
                '({"prompt_token_ids": [...]} lines in --input); or pass --tokenizer DIR'
            )
        if "messages" in item:
            text = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)  # the template writes BOS itself
        else:
            if not isinstance(item["prompt"], str):
                raise ValueError(f"{where}: prompt must be a string")
            text, ids = item["prompt"], tokenizer.encode(item["prompt"])
        prompts.append({"prompt": text, "prompt_token_ids": ids})
    for item, prompt in zip(items, prompts):
        if not prompt["prompt_token_ids"]:
            raise ValueError(f"{item.get('_where', 'a prompt')}: the prompt is empty (it has no tokens)")
    return prompts


def size_to_job(
    args: argparse.Namespace, model: ModelConfig, prompts: list[dict], params: list[SamplingParams]
) -> dict:
    """Engine limits for this job where the flags leave them open: the context from the longest
    request; a job of fewer sequences than any device's default (`defaults.MAX_NUM_SEQS`) gets
    that many, and a token budget from its prompts (fewer, smaller step programs). A larger job
    keeps the device's defaults (vLLM's on a GPU: `defaults.batch_limits`), as vLLM's `LLM` does.
    Every request must fit the model's limit.

    Raises:
      ValueError: a request longer than --max-model-len or the model's context, naming it.
    """
    lengths = [len(p["prompt_token_ids"]) + sp.max_tokens for p, sp in zip(prompts, params)]
    limit = model.max_context_len
    given = args.max_model_len
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] > (given or limit):
        what = f"--max-model-len {given}" if given else f"the model's context of {limit} tokens"
        raise ValueError(
            f"prompt {longest + 1} has {len(prompts[longest]['prompt_token_ids'])} tokens; with max_tokens "
            f"{params[longest].max_tokens} it needs {lengths[longest]}, more than {what}; shorten it or lower --max-tokens"
        )
    sizes = {"max_model_len": given or lengths[longest]}
    sequences = sum(sp.n for sp in params)  # n > 1: each prompt runs n sequences
    if args.max_num_seqs is None and sequences < defaults.MAX_NUM_SEQS:
        sizes["max_num_seqs"] = min(sequences, args.max_num_batched_tokens or sequences)
    seqs = sizes.get("max_num_seqs", args.max_num_seqs)
    if args.max_num_batched_tokens is None and seqs is not None:
        total = sum(len(p["prompt_token_ids"]) for p in prompts)
        sizes["max_num_batched_tokens"] = min(defaults.max_num_batched_tokens(seqs), max(total, seqs))
    return sizes


def run(args: argparse.Namespace) -> int:
    """`jaxpaged generate` with parsed arguments."""
    items = read_items(args)
    # A model directory without tokenizer files (or a preset) runs on token ids.
    model = args.model or DEMO_MODEL_DIR
    skip = args.skip_tokenizer_init or tokenizer_dir(model, args.tokenizer) is None
    placeholder = {} if args.max_num_seqs is not None else dict(max_num_seqs=1)
    resolved = engine_config(args, skip_tokenizer_init=skip, **placeholder)  # every flag checked before anything slow
    load = resolved.load
    params = [sampling_params(args, item, dict(load.sampling_defaults)) for item in items]
    logger.info("generate: %d prompt(s); model %s", len(items), load.model)
    tokenizer = None
    if not skip:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(load.tokenizer)
    prompts = tokenize(items, tokenizer)
    sizes = size_to_job(args, resolved.model, prompts, params)
    options = engine_options(args, **sizes, skip_tokenizer_init=skip, seed=load.seed)
    config = EngineConfig.resolve(options)  # the job's sizes: the engine runs with this, not resolved again
    for note in compatibility_notes(options):
        logger.info(note)

    from jaxpaged.entrypoints.llm import LLM  # JAX is imported from here on

    llm = LLM.from_engine_config(config)
    outputs = llm.generate(prompts, params, use_tqdm=bool(args.input))
    if args.output:
        with open(args.output, "w") as f:
            for item, prompt, out in zip(items, prompts, outputs):
                f.write(json.dumps(_record(item, prompt, out), ensure_ascii=False) + "\n")
        print(f"wrote {len(outputs)} completions to {args.output}", file=sys.stderr)
        return 0
    for prompt, out in zip(prompts, outputs):
        c = out.outputs[0]
        if tokenizer is None:
            print(json.dumps({"prompt_token_ids": prompt["prompt_token_ids"], "token_ids": c.token_ids}))
        else:
            print(prompt["prompt"] + c.text)
            print()
    return 0


def _record(item: dict, prompt: dict, out) -> dict:
    c = out.outputs[0]
    record = {k: v for k, v in item.items() if k != "_where"}
    if "messages" in item:
        record["prompt"] = prompt["prompt"]  # the rendered conversation
    return {**record, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
