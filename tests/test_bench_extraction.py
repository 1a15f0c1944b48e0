"""`bench extraction`: the clinical-notes workload's prompts, schema check and flags, and one
constrained configuration end to end on the demo model."""

import argparse
import json

import pytest
from transformers import AutoTokenizer

from jaxpaged.bench import extraction, extraction_data, extraction_run
from jaxpaged.cli import main
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR


def test_prompts_share_an_exact_prefix_and_notes_keep_their_lengths():
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    prompts = extraction_data.extraction_prompts(tokenizer, 6, prefix_len=700, note_len=(20, 90), seed=3)
    cue = tokenizer.encode("\nJSON: ", add_special_tokens=False)
    assert all(p[:700] == prompts[0][:700] for p in prompts)  # one shared prefix (repeated examples to 700)
    assert all(20 <= len(p) - 700 - len(cue) <= 90 and p[-len(cue) :] == cue for p in prompts)
    assert len({tuple(p) for p in prompts}) == 6
    assert prompts == extraction_data.extraction_prompts(tokenizer, 6, prefix_len=700, note_len=(20, 90), seed=3)


def test_schema_accepts_the_examples_and_nothing_else():
    for _, answer in extraction_data.EXAMPLES:
        assert extraction_data.is_valid(json.dumps(answer))
    wrong = dict(extraction_data.EXAMPLES[0][1], severity="fatal")
    assert not extraction_data.is_valid(json.dumps(wrong))
    assert not extraction_data.is_valid(json.dumps(extraction_data.EXAMPLES[0][1])[:-1])  # cut short
    assert not extraction_data.is_valid("Patient is a 67 year old male")
    assert len(extraction_data.SCHEMA["properties"]) == 12


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("note_len", "100", "--note-len '100': give MIN,MAX"),
        ("note_len", "50,10", "need 1 <= MIN <= MAX"),
        ("configs", "json+prefix-cache,fast", "--configs: unknown fast"),
        ("num_prompts", 0, "--num-prompts 0"),
    ],
)
def test_bad_flags_are_named(flag, value, message):
    args = argparse.Namespace(
        note_len="10,20", num_prompts=4, output_len=8, prefix_len=0, configs=",".join(extraction.CONFIGS)
    )
    setattr(args, flag, value)
    with pytest.raises(ValueError, match=message):
        extraction.check_flags(args)


def test_requests_longer_than_the_models_context_are_refused_before_any_run(capsys):
    """The seed workload's 900-token prefix does not fit the demo model's 1,024 tokens with a note
    and an answer: one error naming the flags and the limit (before, every configuration failed
    in its own process with a traceback naming --max-tokens, a flag the command does not have)."""
    argv = ["bench", "extraction", "--num-prompts", "2", "--prefix-len", "900", "--note-len", "100,200"]
    assert main([*argv, "--output-len", "64"]) == 2
    err = capsys.readouterr().err
    assert "--prefix-len 900" in err and "--output-len 64" in err and "context of 1024 tokens" in err
    assert "running" not in err  # no configuration started


def test_a_constrained_configuration_end_to_end(tmp_path, capsys):
    """One configuration in its own process (the others differ only in engine flags and whether
    the schema is sent), speculating (n-gram and the grammar's forced tokens): every output
    follows the schema, the shared prefix is hit, proposals were checked."""
    out = tmp_path / "extraction.json"
    argv = ["bench", "extraction", "--num-prompts", "4", "--prefix-len", "200", "--note-len", "20,60"]
    argv += ["--output-len", "450", "--configs", "json+prefix-cache+speculation", "--output-json", str(out)]
    argv += [
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--num-scheduler-steps",
        "1",
        "--dtype",
        "float32",
    ]
    assert main(argv) == 0
    run = json.loads(out.read_text())["runs"]["json+prefix-cache+speculation"]
    assert run["valid_fraction"] == 1.0 and run["finish_reasons"] == {"stop": 4} and run["num_requests"] == 4
    assert run["prefix_cache_hit_rate"] > 0 and run["ttft_ms"]["p99"] >= run["ttft_ms"]["p50"] > 0
    assert run["speculation"]["spec_decode_num_accepted_tokens"] > 0
    # forced runs and accepted proposals: fewer steps than tokens
    assert 0 < run["engine_steps"] < run["total_output_tokens"] and run["step_ms"] > 0
    assert "| json+prefix-cache+speculation | " in capsys.readouterr().out


def test_every_configuration_name_reads_as_its_modes():
    modes = {config: extraction_run.config_modes(config) for config in extraction.CONFIGS}
    assert modes["json+prefix-cache"] == (True, "prefix-cache", False, False)
    assert modes["free+host-tier"] == (False, "host-tier", False, False)
    assert modes["json+prefix-cache+speculation"] == (True, "prefix-cache", True, False)
    assert modes["json+prefix-cache+overlapped"] == (True, "prefix-cache", False, True)
    assert {cache for _, cache, _, _ in modes.values()} == {"prefix-cache", "no-prefix-cache", "host-tier"}
