"""The examples run: the step function inside user JAX code (jit prefill, lax.scan decode)."""

import os
import subprocess
import sys

from engine_fixtures import hf_greedy, make_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_step_function_example_decodes_like_transformers(tmp_path):
    hf_model = make_model_dir(str(tmp_path))
    script = os.path.join(ROOT, "examples", "step_function.py")
    out = subprocess.run(
        [sys.executable, script, "--model", str(tmp_path), "--prompt", "the quick brown fox", "--new-tokens", "12"],
        capture_output=True, text=True, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    ).stdout  # fmt: skip
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = tokenizer.encode("the quick brown fox")
    expected = "the quick brown fox" + tokenizer.decode(hf_greedy(hf_model, prompt, 12), skip_special_tokens=True)
    assert out.rstrip("\n") == expected
