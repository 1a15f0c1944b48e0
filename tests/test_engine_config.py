"""The one-way configuration: `EngineArgs` checks values and reads no file; `EngineConfig.resolve`
reads each model's config.json once and names the option behind whatever it refuses; every
default is declared once (`jaxpaged.config.defaults`) and every component agrees with it."""

import dataclasses
import inspect
import json
import shutil

import pytest

from jaxpaged.cli import build_parser
from jaxpaged.config import defaults, presets
from jaxpaged.core.scheduler import SchedulerConfig
from jaxpaged.engine_args import EngineArgs, EngineArgsError
from jaxpaged.engine_config import EngineConfig
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
from jaxpaged.planning.memory import plan_kv_cache
from jaxpaged.planning.plan import make_plan
from jaxpaged.sampling_params import SamplingParams


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
    assert config.max_model_len == 64 and config.load.seed is not None


def test_the_engine_loads_its_weights_from_the_resolved_config_without_reading_config_json_again(reads):
    """The loader takes the model's configuration and how its weights are stored from the
    resolved config (`EngineConfig.model`, `LoadConfig.checkpoint`): one read per start-up."""
    from jaxpaged.engine.setup import build_model
    from jaxpaged.parallel.mesh import TensorParallel, make_mesh

    config = EngineConfig.resolve(EngineArgs(model=DEMO_MODEL_DIR, max_model_len=64, quantization="int8"))
    model = build_model(config, TensorParallel(config.layout, make_mesh(1)))
    assert reads == [DEMO_MODEL_DIR]
    assert model.layers.attn.q_proj_quant.get_value()[0].dtype.name == "int8"


def test_a_quantized_draft_model_is_refused_and_a_targets_format_is_not_asked_of_the_draft(tmp_path):
    """The draft runs unquantized: a pre-quantized draft checkpoint is refused naming
    speculative_config; `quantization` (the target's) is not checked against the draft's files."""
    draft = tmp_path / "draft"
    shutil.copytree(DEMO_MODEL_DIR, draft)
    raw = json.loads((draft / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 64,
        "zero_point": True,
        "version": "gemm",
    }
    (draft / "config.json").write_text(json.dumps(raw))
    spec = {"model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(EngineArgsError, match="the draft model: its checkpoint is quantized .awq.") as err:
        EngineConfig.resolve(EngineArgs(model=DEMO_MODEL_DIR, speculative_config=spec))
    assert err.value.field == "speculative_config"
    plain = {"model": DEMO_MODEL_DIR, "num_speculative_tokens": 2}
    config = EngineConfig.resolve(EngineArgs(model=DEMO_MODEL_DIR, quantization="int8", speculative_config=plain))
    assert config.draft.path == DEMO_MODEL_DIR


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
        (dict(quantization="fp8", quantization_group_size=64), "quantization_group_size", "weights here are fp8"),
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


def _field_defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


def _signature_defaults(fn) -> dict:
    return {name: p.default for name, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}


def _flag_defaults(command: str) -> dict:
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    return {a.dest: a.default for a in commands[command]._actions if a.option_strings}


def test_every_default_is_the_engine_args_one():
    """`EngineArgs`, the scheduler, `jaxpaged plan` (function and flags), `serve`'s flags, the
    model and the loader take their defaults from `jaxpaged.config.defaults`: none disagrees."""
    from jaxpaged.checkpoint.loader import load_model
    from jaxpaged.model import Llama

    engine = _field_defaults(EngineArgs)
    assert engine["max_num_seqs"] is engine["max_num_batched_tokens"] is None  # the device's: batch_limits
    cpu = defaults.batch_limits("llm_class", "cpu", "cpu", None, 128)
    engine["max_num_seqs"], engine["max_num_batched_tokens"] = cpu
    assert cpu == (defaults.MAX_NUM_SEQS, defaults.max_num_batched_tokens(defaults.MAX_NUM_SEQS))
    others = {
        "SchedulerConfig": _field_defaults(SchedulerConfig),
        "make_plan": _signature_defaults(make_plan),
        "jaxpaged plan": _flag_defaults("plan"),
        "jaxpaged serve": _flag_defaults("serve"),
        "plan_kv_cache": _signature_defaults(plan_kv_cache),
        "Llama": {"scan_layers": _signature_defaults(Llama.__init__)["scan_layers"]},  # its dtype is a dtype
        "load_model": _signature_defaults(load_model),
    }
    for fn in (Llama.__init__, load_model):
        others[fn.__qualname__ + " attention"] = {"attention_backend": _signature_defaults(fn)["attention"]}
    compared = 0
    for where, values in others.items():
        for name, value in values.items():
            if name in engine and name != "model" and None not in (value, engine[name]):  # None: resolved later
                assert value == engine[name], f"{where}: {name}={value!r}, EngineArgs: {engine[name]!r}"
                compared += 1
    assert compared >= 25
    for name in ("block_size", "max_num_seqs", "gpu_memory_utilization", "num_scheduler_steps", "scan_layers"):
        assert engine[name] == getattr(defaults, name.upper())


def test_every_option_lands_in_exactly_one_part():
    """Each `EngineArgs` option is held by one part of `EngineConfig` (or is the context limit or
    the speculative options, resolved on the config itself), with its value as given."""
    from jaxpaged.config.sections import SECTIONS

    holders = {}
    for name, part in SECTIONS.items():
        for f in dataclasses.fields(part):
            holders.setdefault(f.name, []).append(name)
    # vLLM-compatibility options change nothing and refused ones are refused: no part holds them
    options = [
        f.name for f in dataclasses.fields(EngineArgs) if not (f.metadata["compatibility"] or f.metadata["refused"])
    ]
    on_config = {"max_model_len", "speculative_config"}
    assert {name: holders.get(name, []) for name in options if len(holders.get(name, [])) != 1} == dict.fromkeys(
        on_config, []
    )
    decided_at_start_up = {"checkpoint", "num_blocks", "num_host_blocks", "sampling_defaults"}
    assert set(holders) - set(options) == decided_at_start_up
    args = EngineArgs(model=DEMO_MODEL_DIR, max_num_seqs=3, block_size=32, compile_threads=3, nnodes=2, node_rank=1)
    config = EngineConfig.resolve(args)
    for name in options:
        if name not in ("tokenizer", "max_model_len"):  # resolved: the model's tokenizer and context
            assert config.option(name) == getattr(args, name), name
    assert config.load.tokenizer == DEMO_MODEL_DIR and config.max_model_len == config.model.max_context_len


def test_components_below_the_engine_never_see_the_options_object():
    """The runner, planner, scheduler, model, loader and start-up receive typed parts of
    `EngineConfig`, never `EngineArgs` (its errors aside: `EngineArgsError` names the option)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent / "jaxpaged"
    below = ["core", "model", "parallel", "checkpoint", "planning", "worker", "functional.py"]
    files = [root / "engine" / "setup.py", root / "engine_config.py"]
    files += [p for name in below for p in ((root / name).rglob("*.py") if (root / name).is_dir() else [root / name])]
    offenders = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "args":
                offenders.append(f"{path.name}:{node.lineno} .args")
            if isinstance(node, ast.Name) and node.id == "EngineArgs" and path.name != "engine_config.py":
                offenders.append(f"{path.name}:{node.lineno} EngineArgs")
    assert offenders == []


def test_generation_config_gives_every_entry_point_the_same_defaults(tmp_path):
    """`--generation-config auto` (the default) reads the model's generation_config.json: the
    demo model's recommends temperature 0.8, top-p 0.95, top-k 40 and 64 tokens; `vllm` ignores it;
    a directory reads that one. LLM.generate and `jaxpaged generate` start from the same values."""
    import argparse

    from jaxpaged.entrypoints.cli_generate import add_generate_flags, sampling_params
    from jaxpaged.entrypoints.llm import LLM

    demo = EngineConfig.resolve(EngineArgs(model="demo"))
    expected = dict(temperature=0.8, top_p=0.95, top_k=40, max_tokens=64)
    got = demo.default_sampling_params()
    assert {k: getattr(got, k) for k in expected} == expected
    assert EngineConfig.resolve(EngineArgs(model="demo", generation_config="vllm")).default_sampling_params() == (
        SamplingParams()
    )
    parser = argparse.ArgumentParser()
    add_generate_flags(parser)
    cli = sampling_params(parser.parse_args(["hi"]), {}, dict(demo.load.sampling_defaults))
    assert {k: getattr(cli, k) for k in expected} == expected  # the CLI: the same defaults
    flagged = sampling_params(parser.parse_args(["--temperature", "0", "hi"]), {}, dict(demo.load.sampling_defaults))
    assert flagged.temperature == 0 and flagged.max_tokens == 64  # a flag overrides only itself
    assert "get_default_sampling_params" in vars(LLM)  # LLM.generate's default (delegates to the config)
    from jaxpaged.server.protocol import ChatCompletionRequest, CompletionRequest

    defaults = dict(demo.load.sampling_defaults)  # the server's (ServingContext.sampling_defaults)
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]})
    served = chat.sampling_params(4096, defaults=defaults)
    assert {k: getattr(served, k) for k in expected} == expected
    completion = CompletionRequest.model_validate({"prompt": "hi", "temperature": 0.2}).sampling_params(4096, defaults)
    assert (completion.temperature, completion.top_p, completion.max_tokens) == (0.2, 0.95, 16)  # OpenAI's 16
    other = tmp_path / "gen"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.3, "repetition_penalty": 1.1, "top_k": 5}')
    mine = EngineConfig.resolve(EngineArgs(model="demo", generation_config=str(other))).default_sampling_params()
    assert (mine.temperature, mine.repetition_penalty, mine.top_k, mine.max_tokens) == (0.3, 1.1, 5, 16)
    with pytest.raises(EngineArgsError, match="generation_config=.*holds no generation_config.json"):
        EngineConfig.resolve(EngineArgs(model="demo", generation_config=str(tmp_path)))
    (other / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(EngineArgsError, match="generation_config=.*temperature must be non-negative"):
        EngineConfig.resolve(EngineArgs(model="demo", generation_config=str(other)))


GiB = 2**30
H100, A100, L4 = ("NVIDIA H100 80GB HBM3", 79 * GiB), ("NVIDIA A100-SXM4-80GB", 79 * GiB), ("NVIDIA L4", 22 * GiB)


@pytest.mark.parametrize(
    "usage, device, max_model_len, given, limits",
    [
        ("llm_class", H100, 2048, (None, None), (1024, 16384)),
        ("openai_api_server", H100, 2048, (None, None), (1024, 8192)),
        ("llm_class", A100, 2048, (None, None), (256, 8192)),  # vLLM PR #17885
        ("openai_api_server", A100, 2048, (None, None), (256, 2048)),
        ("openai_api_server", L4, 2048, (None, None), (256, 2048)),
        ("openai_api_server", H100, 4, (None, None), (1024, 4096)),  # tokens at most seqs x context
        ("llm_class", H100, 4, (8, None), (8, 32)),
        ("llm_class", H100, 2048, (None, 512), (512, 512)),  # seqs at most the token budget
        ("llm_class", H100, 2048, (2048, None), (2048, 16384)),
        ("llm_class", ("cpu", None), 2048, (None, None), (256, 2048)),  # jaxpaged's own on a CPU
        ("llm_class", ("cpu", None), 2048, (4096, None), (4096, 4096)),
    ],
)
def test_unset_batch_limits_are_vllms_for_the_device(usage, device, max_model_len, given, limits):
    """vLLM's `EngineArgs.get_batch_defaults` and its clamps (vllm/engine/arg_utils.py)."""
    kind, memory = device
    platform = "cpu" if kind == "cpu" else "gpu"
    assert defaults.batch_limits(usage, platform, kind, memory, max_model_len, *given) == limits


def test_a_default_token_budget_below_max_num_seqs_is_refused_naming_it():
    from jaxpaged.config.checks import OptionError

    args = EngineArgs(model=DEMO_MODEL_DIR, max_num_seqs=20000)
    scheduling = EngineConfig.resolve(args).scheduling
    with pytest.raises(OptionError, match="max_num_batched_tokens=16384: must be at least max_num_seqs"):
        scheduling.with_batch_limits("gpu", *H100, max_model_len=2048)
    with pytest.raises(EngineArgsError, match="usage_context"):
        EngineArgs(model=DEMO_MODEL_DIR, usage_context="server")
