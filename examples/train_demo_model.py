#!/usr/bin/env python3
"""Train the tiny demo model that ships inside ``jaxpaged/demo_model/``.

The demo model exists so that jaxpaged's examples, tests and CLI have a real
Hugging Face Llama checkpoint (config, safetensors weights, tokenizer, chat
template) that is small enough to live in the package and to run anywhere,
and that nonetheless produces readable English instead of random tokens.

What this script does, end to end:

1. Reads the King James Bible from Debian's ``bible-kjv-text`` package (public
   domain text).  The package stores the text in a compressed random-access
   format (``/usr/lib/bible.data``); it is decompressed with the ``bible``
   reader from the companion ``bible-kjv`` package, which prints one verse per
   line as ``Ge1:1 In the beginning ...``.  The ``Ge1:1`` reference prefixes
   are stripped so the model learns plain prose.
2. Trains a byte-level BPE tokenizer (HF ``tokenizers``, vocab 4096, ByteLevel
   pre-tokenizer and decoder, so any UTF-8 text round-trips) with the special
   tokens ``<|begin_of_text|>`` (BOS), ``<|end_of_text|>`` (EOS), ``<|user|>``,
   ``<|assistant|>`` and ``<|system|>``.  Encoding a prompt prepends BOS, and
   a small Jinja chat template is attached.
3. Builds a tiny ``LlamaForCausalLM`` (hidden 256, 4 layers, 4 query heads,
   2 KV heads so head_dim 64 and GQA is exercised, intermediate 704, tied
   embeddings, RoPE theta 10000) -- about 4.0M parameters, 8 MB in bfloat16.
4. Trains it with torch on CPU: AdamW, linear warm-up then cosine decay,
   256-token sequences packed from the verse stream (``BOS verse EOS`` per
   verse), bf16 autocast.  Training stops at a wall-clock budget (the cosine
   schedule is driven by the fraction of the budget used, so the LR reaches its
   floor exactly when time runs out, however fast the machine is).
5. Saves model (bfloat16 safetensors), generation config and tokenizer with
   ``save_pretrained`` plus a README, reloads everything from disk, runs a few
   sanity checks and prints greedy and sampled continuations.

How to run (as root, or install the packages some other way)::

    apt-get install -y bible-kjv-text bible-kjv
    python examples/train_demo_model.py --out-dir jaxpaged/demo_model \\
        --time-budget-min 20 --seed 0

Requirements: torch, transformers, tokenizers, safetensors, numpy.  No network
access is needed apart from installing the Debian packages.  If the ``bible``
reader is unavailable, ``--text-file`` accepts a plain-text dump with one
verse per line (reference prefixes optional).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
SPECIAL_TOKENS = [BOS, EOS, "<|user|>", "<|assistant|>", "<|system|>"]

# Each message becomes "<|role|>\n{content}<|end_of_text|>\n"; the whole
# conversation is preceded by BOS (apply_chat_template tokenizes without adding
# special tokens, so the template has to emit BOS itself, as Llama 3's does).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|>\\n' -}}"
    "{%- endif -%}"
)

# "Ge1:1 ", "1Sa3:10 ", "Rev22:21 " ...
VERSE_REF = re.compile(r"^\s*[1-3]?[A-Za-z]+\s*\d+:\d+\s+")

MAX_WEIGHT_BYTES = 10_000_000  # the package must stay small: <= 10 MB of bf16 weights

# Files kept in the output directory; anything else save_pretrained writes is
# removed.  (chat_template.jinja is where transformers >= 4.51 / 5.x put the
# template; special_tokens_map.json is written by 4.x only.)
KEEP_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "README.md",
}

SAMPLE_PROMPTS = ["In the beginning", "And the LORD said", "Blessed are the", "The kingdom of heaven"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- data


def read_kjv_lines(text_file: str | None, bible_bin: str) -> list[str]:
    """Return the raw KJV lines (one verse per line, possibly with references)."""
    if text_file:
        return Path(text_file).read_text(encoding="utf-8").splitlines()
    exe = shutil.which(bible_bin)
    if exe is None:
        sys.exit(
            f"'{bible_bin}' not found. Install the text and its reader with\n"
            "    apt-get install -y bible-kjv-text bible-kjv\n"
            "or pass --text-file with one verse per line."
        )
    # -f toggles pretty-printing off: one verse per line, prefixed by its reference.
    out = subprocess.run(
        [exe, "-f", "Gen1:1-Rev22:21"], check=True, capture_output=True, text=True, encoding="utf-8"
    ).stdout
    return out.splitlines()


def clean_verses(lines: list[str]) -> list[str]:
    verses = []
    for line in lines:
        text = VERSE_REF.sub("", line, count=1)
        text = " ".join(text.split())  # normalise whitespace
        if text:
            verses.append(text)
    return verses


# ---------------------------------------------------------------------- tokenizer


def train_tokenizer(verses: list[str], vocab_size: int):
    """Byte-level BPE with BOS prepended on encode and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())  # no unk token: byte-level covers every input
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,  # ids 0..4, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes
        show_progress=False,
    )
    tok.train_from_iterator(verses, trainer=trainer, length=len(verses))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0",
        pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, bos_id)],
    )

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,  # no dedicated pad token; padding is masked anyway
        additional_special_tokens=SPECIAL_TOKENS[2:],
        add_bos_token=True,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids for a decoder
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def check_tokenizer(tok) -> None:
    """Assertions that must hold for the tokenizer we ship."""
    bos_id, eos_id = tok.bos_token_id, tok.eos_token_id
    ids = tok("In the beginning")["input_ids"]
    assert ids[0] == bos_id and ids.count(bos_id) == 1, ids
    assert eos_id not in ids, ids
    for s in ["In the beginning God created the heaven and the earth.", "naïve café — ✓", "日本語 😀\n\ttabs"]:
        enc = tok(s, add_special_tokens=False)["input_ids"]
        assert tok.decode(enc) == s, (s, tok.decode(enc))
        assert tok.decode(tok(s)["input_ids"], skip_special_tokens=True) == s
    for t in SPECIAL_TOKENS:  # each special token is a single id
        assert len(tok(t, add_special_tokens=False)["input_ids"]) == 1, t
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == f"{BOS}<|user|>\nhi{EOS}\n<|assistant|>\n", repr(chat)
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):  # transformers 5 returns a BatchEncoding
        chat_ids = chat_ids["input_ids"]
    assert chat_ids[0] == bos_id and chat_ids.count(bos_id) == 1, chat_ids


# -------------------------------------------------------------------------- model


def build_model(vocab_size: int, bos_id: int, eos_id: int, pad_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=704,
        hidden_act="silu",
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.02,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())  # tied weights counted once
    bf16_bytes = n_params * 2
    log(f"model: {n_params:,} parameters = {bf16_bytes / 1e6:.2f} MB in bfloat16")
    assert bf16_bytes <= MAX_WEIGHT_BYTES, f"weights too large: {bf16_bytes} bytes"
    return model


# ----------------------------------------------------------------------- training


def encode_stream(tok, verses: list[str]) -> np.ndarray:
    """Concatenate ``BOS verse EOS`` for every verse into one token stream."""
    enc = tok(verses, add_special_tokens=False)["input_ids"]
    out = []
    for ids in enc:
        out.append(tok.bos_token_id)
        out.extend(ids)
        out.append(tok.eos_token_id)
    return np.asarray(out, dtype=np.int64)


class PackedBatches:
    """Random non-overlapping windows of ``seq_len`` tokens; new offset each epoch."""

    def __init__(self, stream: np.ndarray, seq_len: int, batch_size: int, rng: np.random.Generator):
        self.stream, self.seq_len, self.batch_size, self.rng = stream, seq_len, batch_size, rng
        self.epoch = 0
        self._queue: list[int] = []

    def _refill(self) -> None:
        offset = int(self.rng.integers(0, self.seq_len))
        n = (len(self.stream) - offset) // self.seq_len
        starts = offset + self.seq_len * np.arange(n)
        self.rng.shuffle(starts)
        self._queue = starts.tolist()
        self.epoch += 1

    def next(self) -> torch.Tensor:
        if len(self._queue) < self.batch_size:
            self._refill()
        starts, self._queue = self._queue[: self.batch_size], self._queue[self.batch_size :]
        return torch.from_numpy(np.stack([self.stream[s : s + self.seq_len] for s in starts]))


@torch.no_grad()
def evaluate(model, stream: np.ndarray, seq_len: int, batch_size: int, use_bf16: bool, max_batches: int = 8) -> float:
    model.eval()
    n = len(stream) // seq_len
    windows = torch.from_numpy(stream[: n * seq_len].reshape(n, seq_len))
    losses = []
    for i in range(0, min(n, max_batches * batch_size), batch_size):
        x = windows[i : i + batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            losses.append(model(input_ids=x, labels=x).loss.float().item())
    model.train()
    return float(np.mean(losses))


def lr_at(step: int, progress: float, args) -> float:
    warm = min(1.0, (step + 1) / args.warmup_steps)
    cos = 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * warm * (args.min_lr_ratio + (1.0 - args.min_lr_ratio) * cos)


def train(model, train_stream, val_stream, args) -> dict:
    rng = np.random.default_rng(args.seed)
    batches = PackedBatches(train_stream, args.seq_len, args.batch_size, rng)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    budget_s = args.time_budget_min * 60.0
    use_bf16 = not args.no_bf16_autocast
    model.train()
    t0 = time.time()  # the budget includes compilation
    # torch.compile is ~20-25% faster per step on CPU; it costs ~30 s up front and
    # shares parameters with `model`, which is what evaluation and saving use.
    fwd = model
    if not args.no_compile:
        try:
            fwd = torch.compile(model)
            x = batches.next()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
                fwd(input_ids=x, labels=x).loss.backward()  # compile now (gradients discarded)
            opt.zero_grad(set_to_none=True)
            log("torch.compile ok")
        except Exception as e:  # no C++ compiler, unsupported platform, ...
            log(f"torch.compile unavailable ({type(e).__name__}: {e}); training eagerly")
            fwd = model
            opt.zero_grad(set_to_none=True)
    step, window, history = 0, [], []
    val_loss = float("nan")
    tokens_per_step = args.batch_size * args.seq_len
    while True:
        elapsed = time.time() - t0
        progress = elapsed / budget_s
        if args.max_steps:
            progress = max(progress, step / args.max_steps)
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x = batches.next()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            loss = fwd(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        window.append(loss.item())
        if step % args.log_every == 0:
            avg = float(np.mean(window))
            history.append(avg)
            window = []
            el = time.time() - t0
            log(
                f"step {step:5d} | epoch {batches.epoch:2d} | loss {avg:.4f} | lr {lr:.2e} | "
                f"{step * tokens_per_step / el:,.0f} tok/s | {el / 60:5.1f}/{args.time_budget_min:g} min"
            )
        if step % args.eval_every == 0:
            val_loss = evaluate(model, val_stream, args.seq_len, args.batch_size, use_bf16)
            log(f"step {step:5d} | val loss {val_loss:.4f}")
    if window:
        history.append(float(np.mean(window)))
    val_loss = evaluate(model, val_stream, args.seq_len, args.batch_size, use_bf16, max_batches=10_000)
    elapsed = time.time() - t0
    final_train = float(np.mean(history[-2:])) if history else float("nan")
    log(f"done: {step} steps in {elapsed / 60:.1f} min, train loss {final_train:.4f}, val loss {val_loss:.4f}")
    return {
        "steps": step,
        "epochs": step * tokens_per_step / len(train_stream),
        "minutes": elapsed / 60,
        "tokens_seen": step * tokens_per_step,
        "train_loss": final_train,
        "val_loss": val_loss,
    }


# ------------------------------------------------------------------------- saving


README_TEMPLATE = """\
# jaxpaged demo model

A tiny Llama-architecture causal language model bundled with jaxpaged so that
examples and tests can run a real Hugging Face checkpoint anywhere. It writes
King-James-Bible-flavoured English; it is a toy for exercising the inference
engine, not a useful language model. Greedy decoding soon loops ("and the
earth, and the earth, ..."); sampling (temperature ~0.8, top-k 40) reads better.

## Architecture

`LlamaForCausalLM` ({n_params:,} parameters, bfloat16 safetensors, {weight_mb:.2f} MB):

| setting | value |
|---|---|
| vocab_size | {vocab} |
| hidden_size | 256 |
| num_hidden_layers | 4 |
| num_attention_heads / num_key_value_heads | 4 / 2 (GQA, head_dim 64) |
| intermediate_size | 704 (SwiGLU) |
| max_position_embeddings | 1024 |
| rope_theta | 10000 |
| rms_norm_eps | 1e-5 |
| tie_word_embeddings | true |

## Tokenizer

Byte-level BPE (HF `tokenizers`, ByteLevel pre-tokenizer and decoder, so any
UTF-8 text round-trips), vocabulary {vocab}. Special tokens:
`<|begin_of_text|>` (BOS, id {bos_id}), `<|end_of_text|>` (EOS and pad, id {eos_id}),
`<|user|>`, `<|assistant|>`, `<|system|>`. Encoding a prompt prepends BOS.
The chat template renders `BOS` followed by `<|role|>\\n{{content}}<|end_of_text|>\\n`
per message, and `<|assistant|>\\n` when `add_generation_prompt=True`.
The model was trained on Bible verses only, never on chat-formatted text.

## Data

The Authorized (King James) Version of the Bible, from the Debian package
`bible-kjv-text` (decompressed with the `bible` reader from `bible-kjv`);
the text is in the public domain (copyright long expired). Verse references
were stripped; each verse was encoded as `BOS verse EOS`, and the stream was
packed into {seq_len}-token sequences. Every 50th verse was held out for validation.

## Training

Trained from scratch on CPU with torch {torch_version}: AdamW (betas 0.9/0.95,
weight decay {wd}), peak LR {lr:g}, {warmup}-step warm-up then cosine decay to
{min_lr_ratio:g}x over a {budget:g}-minute wall-clock budget, batch {batch} x {seq_len}
tokens, bf16 autocast: {steps} steps ({epochs:.1f} epochs, {tokens_m:.1f}M tokens) in
{minutes:.1f} minutes on 2 CPU cores (shared with other jobs, so the step count
depends on machine load).

Final training loss **{train_loss:.3f}**, held-out validation loss **{val_loss:.3f}**
(nats per token).

Reproduce with:

```
apt-get install -y bible-kjv-text bible-kjv
{command}
```
"""


def make_portable(out_dir: Path) -> None:
    """Make the saved files loadable by transformers 4.x as well as 5.x.

    transformers 5 writes ``tokenizer_class: TokenizersBackend``, a list-valued
    ``extra_special_tokens`` and ``rope_parameters``, none of which 4.x
    understands.  Both versions accept the older spellings used here (5.x maps
    ``additional_special_tokens``/``rope_theta``/``torch_dtype`` onto the new
    names), and the BOS-prepending post-processor lives in tokenizer.json anyway.
    """
    path = out_dir / "tokenizer_config.json"
    tc = json.loads(path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    extra = tc.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        tc["additional_special_tokens"] = extra
    elif extra:  # a dict, as written by 4.x: keep it
        tc["extra_special_tokens"] = extra
    tc["add_bos_token"] = True
    tc["add_eos_token"] = False
    tc.setdefault("model_input_names", ["input_ids", "attention_mask"])
    path.write_text(json.dumps(tc, indent=2, ensure_ascii=False, sort_keys=True) + "\n")

    path = out_dir / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters") or {}
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    cfg.setdefault("torch_dtype", cfg.get("dtype", "bfloat16"))
    cfg.setdefault("dtype", cfg["torch_dtype"])
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_all(model, tok, out_dir: Path, stats: dict, args, command: str) -> None:
    from transformers import GenerationConfig

    if out_dir.exists() and any(out_dir.iterdir()):
        if not (out_dir / "config.json").exists() and not args.overwrite:
            sys.exit(f"{out_dir} is not empty and holds no model; pass --overwrite to replace it")
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    model = model.to(torch.bfloat16)
    model.config.use_cache = True
    # The sampling the model's card recommends, as real checkpoints ship it: LLM.generate, `jaxpaged
    # generate` and the server default to it (greedy decoding soon loops on a model this small).
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=True,
        temperature=0.8,
        top_p=0.95,
        top_k=40,
        max_new_tokens=64,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        for f in sorted(Path(tmp).iterdir()):
            if f.name in KEEP_FILES and f.is_file():
                shutil.copy2(f, out_dir / f.name)
            else:
                log(f"dropping {f.name} (not needed)")

    make_portable(out_dir)
    n_params = sum(p.numel() for p in model.parameters())
    weight_bytes = (out_dir / "model.safetensors").stat().st_size
    assert weight_bytes <= MAX_WEIGHT_BYTES, f"model.safetensors is {weight_bytes} bytes"
    cfg = json.loads((out_dir / "config.json").read_text())
    assert cfg.get("torch_dtype", cfg.get("dtype")) == "bfloat16", cfg
    readme = README_TEMPLATE.format(
        n_params=n_params,
        weight_mb=weight_bytes / 1e6,
        vocab=len(tok),
        bos_id=tok.bos_token_id,
        eos_id=tok.eos_token_id,
        seq_len=args.seq_len,
        torch_version=torch.__version__.split("+")[0],
        wd=args.weight_decay,
        lr=args.lr,
        warmup=args.warmup_steps,
        min_lr_ratio=args.min_lr_ratio,
        budget=args.time_budget_min,
        batch=args.batch_size,
        tokens_m=stats["tokens_seen"] / 1e6,
        command=command,
        **{k: v for k, v in stats.items() if k != "tokens_seen"},
    )
    (out_dir / "README.md").write_text(readme, encoding="utf-8")
    total = sum(f.stat().st_size for f in out_dir.iterdir())
    log(f"saved to {out_dir}: weights {weight_bytes / 1e6:.2f} MB, directory {total / 1e6:.2f} MB")
    for f in sorted(out_dir.iterdir()):
        log(f"  {f.name:26s} {f.stat().st_size:>10,d} bytes")


def show_samples(out_dir: Path, seed: int) -> None:
    """Reload the saved artifacts from disk and print some continuations."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(out_dir)
    check_tokenizer(tok)
    model = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    model.eval()
    for mode in ("greedy", "sampled"):
        torch.manual_seed(seed)
        print(f"\n===== {mode} continuations =====", flush=True)
        for prompt in SAMPLE_PROMPTS:
            inputs = tok(prompt, return_tensors="pt")
            kwargs = (
                dict(do_sample=False)
                if mode == "greedy"
                else dict(do_sample=True, temperature=0.8, top_p=0.95, top_k=0)
            )
            with torch.no_grad():
                out = model.generate(**inputs, max_new_tokens=48, **kwargs)
            text = tok.decode(out[0], skip_special_tokens=False)
            print(f"- {text!r}", flush=True)


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out-dir", default="jaxpaged/demo_model", help="where to write the model (default: %(default)s)")
    p.add_argument(
        "--time-budget-min",
        type=float,
        default=20.0,
        help="wall-clock training budget in minutes (default: %(default)s)",
    )
    p.add_argument("--max-steps", type=int, default=0, help="optional cap on optimizer steps (0 = budget only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.05, help="final LR as a fraction of the peak")
    p.add_argument("--warmup-steps", type=int, default=60)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--no-compile", action="store_true", help="do not use torch.compile")
    p.add_argument(
        "--no-bf16-autocast", action="store_true", help="train in float32 (slower on CPUs with bf16 support)"
    )
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--text-file", default=None, help="use this one-verse-per-line text instead of the `bible` reader")
    p.add_argument("--bible-bin", default="bible", help="the bible-kjv reader executable")
    p.add_argument("--overwrite", action="store_true", help="replace a non-model --out-dir")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    command = "python examples/train_demo_model.py " + " ".join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    out_dir = Path(args.out_dir)

    verses = clean_verses(read_kjv_lines(args.text_file, args.bible_bin))
    log(f"read {len(verses):,} verses, {sum(map(len, verses)) / 1e6:.2f}M characters")
    log(f"first verse: {verses[0]!r}")

    tok = train_tokenizer(verses, args.vocab_size)
    check_tokenizer(tok)
    log(f"tokenizer: {len(tok)} tokens, BOS={tok.bos_token_id} EOS={tok.eos_token_id}")

    val_verses = verses[::50]
    train_verses = [v for i, v in enumerate(verses) if i % 50]
    train_stream = encode_stream(tok, train_verses)
    val_stream = encode_stream(tok, val_verses)
    log(
        f"tokens: train {len(train_stream):,}, val {len(val_stream):,} "
        f"({sum(map(len, verses)) / (len(train_stream) + len(val_stream)):.2f} chars/token incl. BOS/EOS)"
    )

    model = build_model(len(tok), tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    stats = train(model, train_stream, val_stream, args)
    save_all(model, tok, out_dir, stats, args, command)
    show_samples(out_dir, args.seed)


if __name__ == "__main__":
    main()
