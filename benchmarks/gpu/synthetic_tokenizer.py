"""A tokenizer of a preset model's vocabulary for runs that have no tokenizer files (the GPU
machine reaches no hub): structured outputs and `jaxpaged bench extraction` on 8B shapes need
one whose ids cover the model's, its BOS and EOS among them.

The demo model's byte-level BPE (4,096 tokens: its merges encode text) is extended to the
preset's `vocab_size` with plain vocabulary entries `zq004096`, `zq004097`, ... (text of their
own: a grammar allows them where such text may go, inside a JSON string), and the preset's BOS
and EOS ids become special tokens of those names. As plain entries (not added tokens) the
fillers cost nothing to load: with 124K added tokens the same tokenizer took 16 s to load and
llguidance 3 minutes to index it, against 0.4 s and 1 s.

    python -m benchmarks.gpu.synthetic_tokenizer --model llama-3.1-8b --out /tmp/llama-tok
    jaxpaged bench extraction --model llama-3.1-8b --load-format dummy --tokenizer /tmp/llama-tok ...
"""

import argparse
import json
import os

from jaxpaged.config.presets import get_preset
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR


def filler(token_id: int) -> str:
    """The text of filler token `token_id`."""
    return f"zq{token_id:06d}"


def write_tokenizer(out_dir: str, vocab_size: int, bos_id: int, eos_ids: list[int]) -> str:
    """Writes the extended demo tokenizer (`tokenizer.json`, `tokenizer_config.json`) to `out_dir`.

    Raises:
      ValueError: a vocabulary smaller than the demo's, or a special id outside it.
    """
    with open(os.path.join(DEMO_MODEL_DIR, "tokenizer.json")) as f:
        spec = json.load(f)
    vocab: dict[str, int] = spec["model"]["vocab"]
    base = len(vocab)
    special = {bos_id: f"<|bos_{bos_id}|>", **{e: f"<|eos_{e}|>" for e in eos_ids}}
    if vocab_size < base or any(not base <= i < vocab_size for i in special):
        raise ValueError(
            f"vocab_size={vocab_size} with BOS {bos_id} and EOS {eos_ids}: the vocabulary must hold the demo "
            f"tokenizer's {base} tokens and the special ids after them"
        )
    for i in range(base, vocab_size):
        vocab[special.get(i, filler(i))] = i
    for i, name in special.items():
        spec["added_tokens"].append(
            {"id": i, "content": name, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False}
            | {"special": True}
        )
    # the template that starts every encoding with BOS names the new one
    template = json.dumps(spec["post_processor"]).replace('"<|begin_of_text|>"', json.dumps(special[bos_id]))
    spec["post_processor"] = json.loads(template.replace('"ids": [0]', f'"ids": [{bos_id}]'))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    with open(os.path.join(DEMO_MODEL_DIR, "tokenizer_config.json")) as f:
        config = json.load(f)
    config.update(bos_token=special[bos_id], eos_token=special[eos_ids[0]], pad_token=special[eos_ids[0]])
    config.pop("added_tokens_decoder", None)  # rebuilt from tokenizer.json
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b", help="a preset name (jaxpaged plan's)")
    parser.add_argument("--out", required=True, help="the directory to write")
    args = parser.parse_args(argv)
    preset = get_preset(args.model)
    if preset is None:
        raise SystemExit(f"--model {args.model!r} is not a preset")
    eos = preset["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    print(write_tokenizer(args.out, preset["vocab_size"], preset["bos_token_id"], eos_ids))


if __name__ == "__main__":
    main()
