"""Pipeline parallelism's options: `pipeline_parallel_size` (`-pp`) and `pp_layer_partition` from
`LLM(...)` and every command's flags to the resolved layout and the settings a multi-process engine
agrees on; every refusal names the option and the fix."""

import types

import jax
import pytest

from jaxpaged.cli import build_parser, main
from jaxpaged.engine.setup import engine_mesh
from jaxpaged.engine.training_loop import TrainingLoopControls
from jaxpaged.engine_args import EngineArgs, EngineArgsError
from jaxpaged.engine_config import EngineConfig
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR, engine_config

DRAFT = {"model": DEMO_MODEL_DIR, "num_speculative_tokens": 2}


def resolve(**options) -> EngineConfig:
    return EngineConfig.resolve(EngineArgs(**{"model": DEMO_MODEL_DIR, **options}))


@pytest.mark.parametrize("command", [["generate"], ["bench", "throughput"], ["bench", "latency"]])
def test_every_engine_command_takes_the_flags(command):
    args = build_parser().parse_args([*command, "-pp", "2", "--pp-layer-partition", "3,1"])
    assert (args.pipeline_parallel_size, args.pp_layer_partition) == (2, "3,1")


def test_serve_flags_resolve_to_the_layout():
    args = build_parser().parse_args(["serve", "-pp", "2", "--pp-layer-partition", "3,1", "-tp", "2"])
    config = engine_config(args)
    assert config.parallel.pipeline_parallel_size == 2 and config.parallel.pp_layer_partition == (3, 1)
    assert config.layout.pipeline.stage_ranges == (range(0, 3), range(3, 4)) and config.layout.num_devices == 4
    assert config.layout.device_config.num_layers == 3  # a device's pool holds its stage's layer slots


def test_python_options_and_the_settings_processes_agree_on():
    """A partition given as text or as a sequence is one value; both sizes and the partition are
    settings every process of a multi-process engine must share."""
    assert (
        EngineArgs(model=DEMO_MODEL_DIR, pipeline_parallel_size=2, pp_layer_partition=[1, 3]).pp_layer_partition
        == "1,3"
    )
    balanced = resolve(pipeline_parallel_size=3)
    assert balanced.layout.pipeline.layers_per_stage == (2, 1, 1) and balanced.parallel.pp_layer_partition is None
    split = resolve(pipeline_parallel_size=2, pp_layer_partition=(1, 3)).shared_settings()
    assert split["pipeline_parallel_size"] == "2" and split["pp_layer_partition"] == "(1, 3)"
    assert resolve(pipeline_parallel_size=2).shared_settings()["pp_layer_partition"] == "None"
    assert resolve().layout.pipeline.size == 1 and resolve().parallel.pipeline_parallel_size == 1


@pytest.mark.parametrize(
    "options, field, reason",
    [
        (dict(pipeline_parallel_size=0), "pipeline_parallel_size", "must be an integer of at least 1"),
        (
            dict(pp_layer_partition="2,x"),
            "pp_layer_partition",
            "must be comma-separated layer counts, one per stage, e.g. 20,12",
        ),
        (
            dict(pipeline_parallel_size=2, scan_layers=True),
            "scan_layers",
            "pipeline parallelism (`pipeline_parallel_size`=2) runs its stages' layers unrolled; drop `scan_layers`",
        ),
        (
            dict(pipeline_parallel_size=2, speculative_config=DRAFT),
            "speculative_config",
            "a draft model does not work with pipeline parallelism yet (`pipeline_parallel_size` > 1); "
            'use {"method": "ngram"}, or a `pipeline_parallel_size` of 1',
        ),
    ],
)
def test_options_refused_before_any_file_is_read(options, field, reason):
    with pytest.raises(EngineArgsError) as err:
        EngineArgs(model=DEMO_MODEL_DIR, **options)
    assert (err.value.field, err.value.reason) == (field, reason)


def test_n_gram_speculation_and_scanned_layers_without_a_pipeline_are_allowed():
    ngram = {"method": "ngram", "num_speculative_tokens": 2}
    assert resolve(pipeline_parallel_size=2, speculative_config=ngram).speculative.method == "ngram"
    assert resolve(pipeline_parallel_size=1, scan_layers=True, speculative_config=DRAFT).draft is not None


@pytest.mark.parametrize(
    "options, field, reason",
    [
        (
            dict(pipeline_parallel_size=5),
            "pipeline_parallel_size",
            "exceeds the model's 4 decoder layers: every stage needs one",
        ),
        (
            dict(pipeline_parallel_size=2, pp_layer_partition="3,2"),
            "pp_layer_partition",
            "must give each of the 2 stages (pipeline_parallel_size) at least one layer and 4 layers in all, e.g. 2,2",
        ),
        (
            dict(pipeline_parallel_size=3, pp_layer_partition="2,2"),
            "pp_layer_partition",
            "must give each of the 3 stages (pipeline_parallel_size) at least one layer and 4 layers in all, e.g. 2,1,1",
        ),
    ],
)
def test_layer_counts_checked_against_the_model(options, field, reason):
    with pytest.raises(EngineArgsError) as err:
        resolve(**options)
    assert (err.value.field, err.value.reason) == (field, reason)


def test_command_line_errors_name_the_flags(capsys):
    assert main(["generate", "-pp", "2", "--pp-layer-partition", "3,2", "hello"]) == 2
    assert capsys.readouterr().err == (
        "jaxpaged: error: --pp-layer-partition 3,2: must give each of the 2 stages (--pipeline-parallel-size) "
        "at least one layer and 4 layers in all, e.g. 2,2\n"
    )
    assert main(["generate", "--pipeline-parallel-size", "2", "--scan-layers", "hello"]) == 2
    assert "--scan-layers True: pipeline parallelism (--pipeline-parallel-size=2)" in capsys.readouterr().err


def test_too_few_devices_for_tp_times_pp():
    config = resolve(tensor_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(EngineArgsError) as err:
        engine_mesh(config, jax.devices()[:3])
    assert (err.value.field, err.value.value) == ("pipeline_parallel_size", 2)
    assert err.value.reason == (
        "tensor_parallel_size x pipeline_parallel_size = 2 x 2 needs 4 devices, but JAX sees 3 (cpu devices); "
        "lower them, or add machines (`nnodes`: a stage per machine)"
    )
    with pytest.raises(EngineArgsError, match="tensor_parallel_size=2: needs 2 devices, but JAX sees 1"):
        engine_mesh(resolve(tensor_parallel_size=2), jax.devices()[:1])
    mesh = engine_mesh(config, jax.devices()[:4]).mesh
    assert dict(mesh.shape) == {"pp": 2, "tp": 2}


def test_training_loop_calls_are_refused_under_pipeline_parallelism():
    """Refused at the entry points, before anything is read or changed; `wake_up` has nothing to
    wake (nothing sleeps)."""
    engine = TrainingLoopControls()
    engine.config = resolve(pipeline_parallel_size=2)
    engine.runner = types.SimpleNamespace(channel=None, draft=None)  # one process, no draft model
    calls = {
        "get_params": engine.get_params,
        "update_weights": lambda: engine.update_weights({}),
        "reload_weights": engine.reload_weights,
        "sleep(1)": lambda: engine.sleep(1),
        "sleep(2)": lambda: engine.sleep(2),
    }
    for what, call in calls.items():
        with pytest.raises(RuntimeError) as err:
            call()
        assert str(err.value) == (
            f"{what} is not supported with pipeline parallelism yet (pipeline_parallel_size=2): each stage holds "
            "only its own layers; start the engine with pipeline_parallel_size=1 for a training loop"
        )
    assert engine.wake_up() is None and not engine.is_sleeping()
