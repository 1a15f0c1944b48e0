"""`jaxpaged generate`: the README's main command, prompts or JSONL in and out."""

import json
import os

from jaxpaged.cli import main
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR


def test_demo_model_is_small_and_complete():
    names = set(os.listdir(DEMO_MODEL_DIR))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert os.path.getsize(os.path.join(DEMO_MODEL_DIR, "model.safetensors")) <= 10 * 2**20


def test_generate_prints_readable_text_with_the_demo_model(capsys):
    assert main(["generate", "--temperature", "0", "--max-tokens", "24", "In the beginning"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("In the beginning")
    words = text.split()
    assert len(words) >= 8
    assert sum(w.strip(".,;:").isalpha() for w in words) >= 0.8 * len(words), text


def test_generate_jsonl_in_and_out(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(
        json.dumps({"prompt": "And God said"})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "Hi"}]})
        + "\n"
    )
    assert main(["generate", "--input", str(src), "--output", str(dst), "--max-tokens", "6", "--ignore-eos"]) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["token_ids"]) == 6 and r["finish_reason"] == "length" for r in rows)
    assert rows[0]["prompt"] == "And God said"


def test_generate_reports_bad_input_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json}\n")
    assert main(["generate", "--input", str(bad)]) == 2
    assert "bad.jsonl:1: not valid JSON" in capsys.readouterr().err
