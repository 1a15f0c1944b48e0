"""Each architecture's parameters as a model state holds them: every parameter of a model state
with its shape and logical axes (quantized pairs included), looked up by path.

The model state holds per-layer parameters stacked, `[L, ...]` under `LAYER_STACK` (and the
engine may split them into per-layer arrays of one layer's shape and axes).
"""

import dataclasses

from jaxpaged.config.architectures import ARCHITECTURES
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params import LAYERS, ParamSpec, Path, axis_sizes

# A parameter as declared, or one array of its quantized pair (group-quantized: triple, and the
# act-order permutation).
ROLES = ("plain", "quant", "scale", "zero", "perm")


@dataclasses.dataclass(frozen=True)
class StateParam:
    """One array of a model state.

    Attributes:
      path: its path in the state (a quantized weight's pair: `<name>_quant`, `<name>_scale`).
      axes: its logical axes (per-layer parameters lead with `LAYERS`: stacked).
      spec: the declaration it comes from.
      role: one of `ROLES`.
    """

    path: Path
    axes: tuple[str, ...]
    spec: ParamSpec
    role: str = "plain"


def param_specs(config: ModelConfig) -> tuple[ParamSpec, ...]:
    """The parameters a model of `config` has, in the table's order."""
    if config.architecture not in ARCHITECTURES:
        raise KeyError(f"architecture {config.architecture!r} is not declared (jaxpaged.config.architectures)")
    return tuple(spec for spec in ARCHITECTURES[config.architecture].params if spec.exists(config))


def state_params(config: ModelConfig, quantized: bool = False) -> dict[Path, StateParam]:
    """Every array of the state of a model of `config` (with `quantized`: its quantizable weights
    replaced by their pairs, or their group-quantized triples when `config.weight_group_size` is
    set), by path, in the table's order."""
    out = {}
    grouped = config.weight_group_size is not None
    for spec in param_specs(config):
        lead = (LAYERS,) if spec.per_layer else ()
        if quantized and spec.quantize:
            axes = spec.grouped_axes(config.weight_act_order) if grouped else spec.quantized_axes
            for path, role_axes, role in zip(quantized_paths(config, spec), axes, ROLES[1:]):
                out[path] = StateParam(path, lead + role_axes, spec, role)
        else:
            out[spec.path] = StateParam(spec.path, lead + spec.axes, spec)
    return out


def quantized_paths(config: ModelConfig, spec: ParamSpec) -> tuple[Path, ...]:
    """The paths of the arrays that replace a quantizable weight under weight quantization: its
    group-quantized triple (and act-order permutation) when `config.weight_group_size` is set,
    else its pair."""
    if config.weight_group_size is not None:
        return spec.grouped_paths(config.weight_act_order)
    return spec.quantized_paths


def find_state_param(config: ModelConfig, path: Path) -> StateParam:
    """The state array at `path`, plain or one array of a quantized pair (or group-quantized triple).

    Raises:
      KeyError: naming a path no parameter of the table has.
    """
    path = tuple(path)
    found = state_params(config).get(path) or state_params(config, quantized=True).get(path)
    if found is not None:
        return found
    raise KeyError(
        f"parameter {'.'.join(path)!r} is not in the {config.architecture} parameter table (jaxpaged.config.architectures)"
    )


def state_shapes(config: ModelConfig, quantization: str | None = None) -> dict[Path, tuple[int, ...]]:
    """Path -> shape of every array of the state (per-layer parameters stacked, `[L, ...]`; a
    quantized weight as its pair when `quantization` is set)."""
    sizes = axis_sizes(config)
    return {path: tuple(sizes[a] for a in p.axes) for path, p in state_params(config, quantization is not None).items()}
