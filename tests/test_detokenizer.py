"""Incremental detokenization: multi-byte characters split across tokens, stop strings."""

import pytest
from transformers import AutoTokenizer

from jaxpaged.core.detokenizer import IncrementalDetokenizer
from jaxpaged.entrypoints.cli import DEMO_MODEL_DIR

TEXT = "In the beginning naïve café — ✓ 日本語 😀 and the earth"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)


def test_multibyte_characters_are_never_split(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # Byte-level BPE splits the CJK characters and the emoji across several tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:"))
    deltas = []
    for token in ids:
        detok.add_token(token)
        deltas.append(detok.take_delta(finished=False))
    deltas.append(detok.take_delta(finished=True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_text_and_is_never_streamed_in_part(tokenizer, include):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [0], stop=["café —"], include_stop_str_in_output=include)
    streamed = ""
    for token in ids:
        stopped = detok.add_token(token)
        streamed += detok.take_delta(finished=stopped)
        if stopped:
            break
    assert detok.stop_reason == "café —"
    expected = "In the beginning naïve " + ("café —" if include else "")
    assert streamed == detok.text == expected
