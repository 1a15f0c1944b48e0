"""What the GPU machine cannot fetch, made on a machine that can: a trimmed ShareGPT file and
wheels of the server's and structured outputs' packages.

- `prepare_dataset`: vLLM's ShareGPT sample (`jaxpaged.bench.sharegpt`, seed 0, counted with the
  Llama-3 tokenizer of the 8B preset) as a file of its conversations' first two turns in the
  sample's order, so that `bench --disable-shuffle` on it draws exactly that sample; and the
  tokenizer's files beside it (the GPU machine lacks the wheel they come from). About 11 MB under
  benchmarks/data/ (untracked and not ignored, so a device call takes it along).
- `prepare_wheels`: fastapi, uvicorn, pydantic, llguidance, jsonschema and what they need, at this environment's
  versions, for CPython 3.12 on x86-64 Linux, into .whl/ (git-ignored: name it in the call's carry).
"""

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version

# What `jaxpaged serve` needs that the GPU image lacks (its package list names none of these).
SERVER_WHEELS = (
    "fastapi",
    "starlette",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "annotated-doc",
    "opentelemetry-api",
    "uvicorn",
)
# What structured outputs and `bench extraction` need that the GPU image lacks: the grammar
# backend, and the schema check of the outputs.
STRUCTURED_WHEELS = ("llguidance", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py")
MANYLINUX = (
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)
DATASET_MODEL = "llama-3.1-8b"  # the benchmark counts its tokens with this model's dataset tokenizer
DATASET_MAX_MODEL_LEN = 2048
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")  # what AutoTokenizer reads of it


def dataset_tokenizer_path(dataset_path: str) -> str:
    """Where `prepare_dataset` puts the tokenizer files that count `dataset_path`'s tokens."""
    return os.path.join(os.path.dirname(dataset_path) or ".", "llama3_tokenizer")


def prepare_dataset(path: str, num_prompts: int) -> dict:
    """Writes vLLM's sample of `num_prompts` ShareGPT requests (in its order) to `path`, and the
    tokenizer that counted them to `dataset_tokenizer_path(path)`; returns what it wrote."""
    from transformers import AutoTokenizer

    from jaxpaged.bench import datasets, sharegpt

    conversations = sharegpt.read_conversations(sharegpt.default_path())
    source = datasets.dataset_tokenizer_dir(DATASET_MODEL, None)
    tokenizer = AutoTokenizer.from_pretrained(source)
    chosen = sharegpt.select_pairs(conversations, tokenizer, num_prompts, sharegpt.DEFAULT_SEED, DATASET_MAX_MODEL_LEN)
    if len(chosen) < num_prompts:
        raise ValueError(f"only {len(chosen)} conversations pass the filter; {num_prompts} were asked for")
    kept = [
        {"id": str(i), "conversations": [{"from": "first", "value": prompt}, {"from": "second", "value": reply}]}
        for i, ((prompt, reply), _, _) in enumerate(chosen)
    ]
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(kept, f, ensure_ascii=False)
    tokenizer_path = dataset_tokenizer_path(path)
    os.makedirs(tokenizer_path, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(source, name), os.path.join(tokenizer_path, name))
    prompt_tokens = sum(len(ids) for _, ids, _ in chosen)
    output_tokens = sum(n for _, _, n in chosen)
    info = {
        "path": path,
        "conversations": len(kept),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "tokenizer": tokenizer_path,
        "bytes": os.path.getsize(path),
    }
    print(
        f"wrote {path}: vLLM's sample of {len(kept)} ShareGPT requests ({prompt_tokens / len(kept):.0f} prompt and "
        f"{output_tokens / len(kept):.0f} output tokens a request, {DATASET_MODEL}'s tokenizer), "
        f"{info['bytes'] / 2**20:.1f} MiB; its tokenizer in {tokenizer_path}",
        flush=True,
    )
    return info


def prepare_wheels(wheel_dir: str) -> list[str]:
    """Downloads the server's and structured outputs' wheels (this environment's versions) for
    CPython 3.12, x86-64 Linux."""
    pins = [f"{name}=={version(name)}" for name in SERVER_WHEELS + STRUCTURED_WHEELS]
    platforms = [flag for tag in MANYLINUX for flag in ("--platform", tag)]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            *platforms,
            "-d",
            wheel_dir,
            *pins,
        ],
        check=True,
    )
    wheels = sorted(f for f in os.listdir(wheel_dir) if f.endswith(".whl"))
    size = sum(os.path.getsize(os.path.join(wheel_dir, f)) for f in wheels)
    print(f"{wheel_dir}: {len(wheels)} wheels, {size / 2**20:.1f} MiB: {', '.join(wheels)}", flush=True)
    return wheels
