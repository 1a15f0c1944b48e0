"""Each architecture's parameters as a model state holds them: every parameter of a model state
with its shape and logical axes (quantized pairs included), looked up by path.

The model state holds per-layer parameters stacked, `[L, ...]` under `LAYER_STACK` (and the
engine may split them into per-layer arrays of one layer's shape and axes).
"""

import dataclasses

from jaxpaged.config.architectures import ARCHITECTURES
from jaxpaged.config.group_formats import GroupFormat
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.spec import LAYERS, ParamSpec, Path, axis_sizes

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
    """The parameters a model of `config` has, in the table's order (a projection of
    `config.float_weights` not `quantize`: the checkpoint stores it in float)."""
    return tuple(
        dataclasses.replace(spec, quantize=False) if spec.path in config.float_weights else spec
        for spec in _declared(config)
    )


def _declared(config: ModelConfig) -> tuple[ParamSpec, ...]:
    """The parameters of `config`'s table that a model of it has, as declared."""
    if config.architecture not in ARCHITECTURES:
        raise KeyError(f"architecture {config.architecture!r} is not declared (jaxpaged.config.architectures)")
    return tuple(spec for spec in ARCHITECTURES[config.architecture].params if spec.exists(config))


def linear_prefixes(spec: ParamSpec, config: ModelConfig, layer: int) -> list[str]:
    """The HF prefixes of a projection in `layer` (e.g. `model.layers.0.self_attn.q_proj`): one
    per expert of a per-expert weight (`...experts.3.w1`), in the experts' order."""
    experts = range(config.moe.num_experts) if spec.per_expert else (None,)
    return [spec.hf_key(layer, expert).removesuffix(".weight") for expert in experts]


def float_weights(config: ModelConfig, fmt: GroupFormat) -> tuple[Path, ...]:
    """The paths of the projections a checkpoint's format leaves in float (`fmt.leaves_float`:
    AWQ's `modules_to_not_convert`, substrings of a module's name, e.g. AutoAWQ's Qwen2-MoE
    `gate` leaves every `gate_proj`, the routers and the shared expert's gate in float;
    compressed-tensors' `ignore`): those whose module in every layer (and expert) is left.

    Raises:
      ValueError: naming a projection's module that the format leaves in float and one of the
        same projection it does not (jaxpaged holds a projection quantized in every layer and
        expert, or in none).
    """
    paths = []
    for spec in (s for s in _declared(config) if s.quantize):
        modules = [m for layer in range(config.num_layers) for m in linear_prefixes(spec, config, layer)]
        left_out = [m for m in modules if fmt.leaves_float(m)]
        if left_out and len(left_out) < len(modules):
            kept = next(m for m in modules if m not in left_out)
            raise ValueError(
                f"{left_out[0]}: quantization_config's {fmt.not_converted_field}={list(fmt.not_converted)} leaves it "
                f"in float but not {kept}; jaxpaged reads a projection quantized in every layer and expert, or in none"
            )
        if left_out:
            paths.append(spec.path)
    return tuple(paths)


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
