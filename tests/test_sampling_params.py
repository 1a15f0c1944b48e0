"""SamplingParams: vLLM's defaults, normalisation and validation messages."""

import dataclasses

import pytest

from jaxpaged.sampling_params import SamplingParams


def test_defaults_match_vllm():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (sp.max_tokens, sp.min_tokens, sp.logprobs, sp.seed) == (16, 0, None, None)
    assert sp.stop == [] and sp.stop_token_ids == [] and not sp.ignore_eos
    assert not sp.include_stop_str_in_output and sp.skip_special_tokens and sp.spaces_between_special_tokens
    assert not sp.greedy
    assert dataclasses.is_dataclass(sp)


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5
    # ints are fine for float fields, as in vLLM
    assert SamplingParams(temperature=1, top_p=1).temperature == 1


def test_greedy():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    sp = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert (sp.top_p, sp.top_k, sp.min_p) == (1.0, 0, 0.0)  # filters are moot when greedy


@pytest.mark.parametrize(
    "kwargs, field, allowed",
    [
        ({"n": 0}, "n", "at least 1"),
        ({"n": 2, "temperature": 0.0}, "n", "greedy"),
        ({"temperature": -0.1}, "temperature", "non-negative"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "at least 1"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"min_p": 1.1}, "min_p", "[0, 1]"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "greater than 0"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"min_tokens": -1}, "min_tokens", "at least 0"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "max_tokens (10)"),
        ({"logprobs": -1}, "logprobs", "non-negative"),
        ({"stop": 3}, "stop", "a str"),
        ({"stop": ["ok", 3]}, "stop", "a str"),
        ({"stop": [""]}, "stop", "non-empty"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids", "list of int"),
        ({"stop_token_ids": 7}, "stop_token_ids", "list of int"),
        ({"top_k": 1.5}, "top_k", "an int"),
        ({"max_tokens": 2.0}, "max_tokens", "an int or None"),
        ({"ignore_eos": "yes"}, "ignore_eos", "a bool"),
        # what the device step holds: int32 and finite float32
        ({"top_k": 2**31}, "top_k", "within ±2147483647"),
        ({"max_tokens": 2**40}, "max_tokens", "within ±2147483647"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids", "token ids up to 2147483647"),
        ({"temperature": float("inf")}, "temperature", "a finite number"),
        ({"temperature": float("nan")}, "temperature", "a finite number"),
        ({"top_p": 1e39}, "top_p", "float32 range"),
        ({"presence_penalty": float("-inf")}, "presence_penalty", "a finite number"),
    ],
)
def test_invalid_values_name_field_value_and_range(kwargs, field, allowed):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert f"SamplingParams.{field}" in message
    assert allowed in message
    assert repr(kwargs[field]) in message


def test_edges_are_accepted():
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3)
    SamplingParams(max_tokens=None, min_tokens=100)  # no cap: min_tokens is free
    SamplingParams(min_tokens=16, max_tokens=16, logprobs=0, seed=0)


def test_text_must_be_valid_unicode_and_any_seed_is_accepted():
    with pytest.raises(ValueError, match="SamplingParams.stop holds an invalid character"):
        SamplingParams(stop=["ok", "\ud800"])
    assert SamplingParams(seed=2**70).seed == 2**70  # the device folds seeds to 32 bits


def test_structured_outputs_params_takes_exactly_one_constraint():
    from jaxpaged.sampling_params import StructuredOutputsParams

    assert StructuredOutputsParams(choice=["a", "b"]).kind == "choice"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="exactly one of .*got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs.choice must be a non-empty list of str"):
        StructuredOutputsParams(choice=[])


@pytest.mark.parametrize(
    "field, value",
    [
        ("logit_bias", {"a": 1.0}),
        ("allowed_token_ids", []),
        ("bad_words", [""]),
        ("truncate_prompt_tokens", 0),
        ("truncate_prompt_tokens", -2),
        ("prompt_logprobs", -1),
        ("structured_outputs", {"json": {}}),
    ],
)
def test_token_control_fields_are_validated(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be"):
        SamplingParams(**{field: value})


def test_min_tokens_and_a_grammar_are_refused_together():
    """min_tokens bans EOS, which a complete document allows alone: refused, naming min_tokens."""
    from jaxpaged.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match="SamplingParams.min_tokens must be 0 with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    assert SamplingParams(min_tokens=2, allowed_token_ids=[5, 6]).min_tokens == 2  # no grammar: fine
