"""The one-way configuration: `EngineArgs` checks values and reads no file; `EngineConfig.resolve`
reads each model's config.json once and names the option behind whatever it refuses."""

import dataclasses

import pytest

from jaxpaged.config import presets
from jaxpaged.engine_args import EngineArgs, EngineArgsError
from jaxpaged.engine_config import EngineConfig
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR


@pytest.fixture
def reads(monkeypatch):
    """The directories whose config.json is opened while the test runs, in order."""
    opened = []
    real = presets.read_config_json

    def counting(directory):
        opened.append(str(directory))
        return real(directory)

    monkeypatch.setattr(presets, "read_config_json", counting)
    return opened


def test_engine_args_read_no_file(reads):
    args = EngineArgs(model=DEMO_MODEL_DIR, max_model_len=64)
    dataclasses.replace(args, seed=None)
    EngineArgs(model="/no/such/dir")  # what is not there is found when resolving
    assert reads == []


@pytest.mark.parametrize("seed", [0, None])
def test_resolve_reads_config_json_once(reads, seed):
    config = EngineConfig.resolve(EngineArgs(model=DEMO_MODEL_DIR, max_model_len=64, seed=seed))
    assert reads == [DEMO_MODEL_DIR]
    assert config.max_model_len == 64 and config.args.seed is not None


def test_resolve_reads_a_draft_models_config_json_once(reads):
    spec = {"model": DEMO_MODEL_DIR, "num_speculative_tokens": 2}
    config = EngineConfig.resolve(EngineArgs(model=DEMO_MODEL_DIR, speculative_config=spec, seed=None))
    assert reads == [DEMO_MODEL_DIR, DEMO_MODEL_DIR]
    assert config.draft.model == config.model and config.draft.path == DEMO_MODEL_DIR


@pytest.mark.parametrize(
    "options, field, words",
    [
        (dict(model="/no/such/dir"), "model", "is not a directory"),
        (dict(model="llama-3.1-8b"), "model", "is a preset"),
        (dict(tensor_parallel_size=3), "tensor_parallel_size", "must divide"),
        (dict(tokenizer="/no/such/dir"), "tokenizer", "has no tokenizer files"),
        (
            dict(speculative_config={"model": "/no/such/dir", "num_speculative_tokens": 2}),
            "speculative_config",
            "draft",
        ),
    ],
)
def test_resolve_names_the_option(options, field, words):
    args = EngineArgs(**{"model": DEMO_MODEL_DIR, **options})
    with pytest.raises(EngineArgsError, match=words) as err:
        EngineConfig.resolve(args)
    assert err.value.field == field
