"""Incremental detokenization: multi-byte characters split across tokens, stop strings."""

import pytest
from transformers import AutoTokenizer

from jaxpaged.core.detokenizer import IncrementalDetokenizer
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR

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


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> str:
    """Feeds `ids` one at a time and returns the streamed deltas, joined."""
    deltas = []
    for token in ids:
        stopped = detok.add_token(token)
        deltas.append(detok.take_delta(finished=stopped))
        if stopped:
            return "".join(deltas)
    return "".join(deltas) + detok.take_delta(finished=True)


@pytest.mark.parametrize("spaces", [True, False])
@pytest.mark.parametrize("prompt_ends_special", [False, True])
def test_spaces_between_special_tokens(tokenizer, spaces, prompt_ends_special):
    bos, eos, assistant = tokenizer.convert_tokens_to_ids(["<|begin_of_text|>", "<|end_of_text|>", "<|assistant|>"])
    prompt = tokenizer.encode("Prompt:") + ([assistant] if prompt_ends_special else [])
    ids = [assistant] + tokenizer.encode(TEXT, add_special_tokens=False) + [eos, bos]
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    # A space between each special token and its neighbours in the output, none after the prompt.
    expected = (
        f"<|assistant|> {TEXT} <|end_of_text|> <|begin_of_text|>"
        if spaces
        else f"<|assistant|>{TEXT}<|end_of_text|><|begin_of_text|>"
    )
    assert _stream(detok, ids) == detok.text == expected


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_reach_stop_strings(tokenizer, spaces):
    eos = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    ids = tokenizer.encode(TEXT, add_special_tokens=False) + [eos]
    detok = IncrementalDetokenizer(
        tokenizer, [0], skip_special_tokens=False, spaces_between_special_tokens=spaces, stop=["earth <|end"]
    )
    text = _stream(detok, ids)
    assert detok.stop_reason == ("earth <|end" if spaces else None)
    assert text == detok.text == (TEXT.removesuffix("earth") if spaces else TEXT + "<|end_of_text|>")


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens_leave_other_text_alone(tokenizer, spaces):
    eos = tokenizer.convert_tokens_to_ids("<|end_of_text|>")
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # Special tokens skipped: the flag has nothing to separate.
    detok = IncrementalDetokenizer(tokenizer, [0], spaces_between_special_tokens=spaces)
    assert _stream(detok, ids + [eos]) == detok.text == TEXT
    # Special tokens kept, but none in the text.
    detok = IncrementalDetokenizer(tokenizer, [0], skip_special_tokens=False, spaces_between_special_tokens=spaces)
    assert _stream(detok, ids) == detok.text == TEXT
