"""LoRA adapters in PEFT's format, as far as config files go (no JAX, no tensors here).

An adapter's `adapter_config.json` says which modules it adapts (`target_modules`: names or a
regular expression), its rank `r` and `lora_alpha` (per module: `rank_pattern`, `alpha_pattern`,
matched as PEFT matches them) and its scaling (`alpha / r`, or `alpha / sqrt(r)` with
`use_rslora`). The modules it may adapt are the model's per-layer projections the parameter table
declares as linear weights of their own (`lora_targets`: attention's q/k/v/o, the MLP's
gate/up/down); what PEFT can save that this engine would compute differently is refused by
name: DoRA, biases, `modules_to_save`, fan-in-fan-out weights, adapted experts or fused tensors.
"""

import dataclasses
import json
import math
import os
import re

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.spec import ParamSpec, axis_sizes
from jaxpaged.config.params.tables import param_specs

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The model modules whose projections carry LoRA deltas (the model applies them in these places).
TARGET_PREFIXES = (("layers", "attn"), ("layers", "mlp"))


def lora_targets(config: ModelConfig) -> dict[str, ParamSpec]:
    """The projections an adapter may adapt, by name (`q_proj`, ...): per-layer linear weights of
    attention and the MLP that are tensors of their own in the checkpoint."""
    return {
        spec.name: spec
        for spec in param_specs(config)
        if spec.path[:2] in TARGET_PREFIXES
        and spec.hf_layout == "linear"
        and spec.per_layer
        and not spec.per_expert
        and spec.fused is None
    }


def projection_dims(config: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """`{projection: (in dims, out dims)}` of each projection an adapter may adapt, in the model's
    einsum layout (`q_proj`: `((D,), (Q, H))`)."""
    sizes, dims = axis_sizes(config), {}
    for name, spec in lora_targets(config).items():
        dims[name] = (
            tuple(sizes[a] for a in spec.axes[: spec.num_in]),
            tuple(sizes[a] for a in spec.axes[spec.num_in :]),
        )
    return dims


def pool_shapes(config: ModelConfig, max_loras: int, max_rank: int) -> dict[str, tuple[tuple, tuple]]:
    """`{projection: (A's shape, B's shape)}` of the device's adapter pool for a model of `config`
    (the mesh's): A `[L, *in, S, R]`, B `[L, S, R, *out]` (`jaxpaged.model.lora`)."""
    layers = config.num_layers
    return {
        name: ((layers, *ins, max_loras, max_rank), (layers, max_loras, max_rank, *outs))
        for name, (ins, outs) in projection_dims(config).items()
    }


def check_adapter_shapes(shapes: dict[str, tuple[tuple, tuple]], config: ModelConfig, max_rank: int) -> None:
    """Checks an adapter given as arrays (`{projection: (A's shape, B's shape)}`, A `[L, *in, r]`,
    B `[L, r, *out]`) against a model of `config` (the mesh's) and the engine's `max_rank`.

    Raises:
      ValueError: no projection, one the model does not adapt, a shape that does not fit, or a rank
        above `max_rank` (each named).
    """
    dims = projection_dims(config)
    if not shapes:
        raise ValueError(f"the adapter adapts no projection; give some of {', '.join(dims)}")
    for name, (a, b) in shapes.items():
        if name not in dims:
            raise ValueError(f"adapter projection {name!r}: not one a LoRA adapter may adapt ({', '.join(dims)})")
        ins, outs = dims[name]
        r = a[-1] if a else 0
        if tuple(a) != (config.num_layers, *ins, r) or tuple(b) != (config.num_layers, r, *outs):
            raise ValueError(
                f"adapter projection {name!r}: A {tuple(a)} / B {tuple(b)} do not fit the model's "
                f"A {(config.num_layers, *ins, 'r')} / B {(config.num_layers, 'r', *outs)}"
            )
        if r > max_rank:
            raise ValueError(f"adapter projection {name!r} has rank {r}, above --max-lora-rank {max_rank}; raise it")


def pool_bytes(config: ModelConfig, max_loras: int, max_rank: int, dtype_bytes: int) -> int:
    """Device bytes of the adapter pool (whole on every device)."""
    return sum(math.prod(a) + math.prod(b) for a, b in pool_shapes(config, max_loras, max_rank).values()) * dtype_bytes


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """What `adapter_config.json` says, checked against the model.

    Attributes:
      targets: the adapted projections (`lora_targets`' names), in the table's order.
      rank: `r`; rank_pattern / alpha_pattern: PEFT's per-module overrides.
      alpha: `lora_alpha`.
      use_rslora: scale by `alpha / sqrt(r)` instead of `alpha / r`.
    """

    targets: tuple[str, ...]
    rank: int
    alpha: float
    use_rslora: bool
    rank_pattern: tuple[tuple[str, int], ...]
    alpha_pattern: tuple[tuple[str, float], ...]

    def rank_of(self, module: str) -> int:
        """The rank of the module at checkpoint key `module` (e.g. "model.layers.0.self_attn.q_proj")."""
        return int(_pattern(self.rank_pattern, module, self.rank))

    def scale_of(self, module: str) -> float:
        """PEFT's scaling of the module's delta: `alpha / r` (rsLoRA: `alpha / sqrt(r)`)."""
        r, alpha = self.rank_of(module), float(_pattern(self.alpha_pattern, module, self.alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern(patterns: tuple[tuple[str, int | float], ...], module: str, default: int | float) -> int | float:
    for key, value in patterns:  # PEFT's rule: the first key the module's name ends with, as a regex
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_adapter_config(path: str, config: ModelConfig) -> AdapterConfig:
    """Reads and checks an adapter's `adapter_config.json` against the model.

    Raises:
      ValueError: a missing file, another PEFT method, an option this engine does not compute,
        or a target module the model lacks (each named, with what would fix it).
    """
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"{path}: no {CONFIG_FILE} there (a PEFT LoRA adapter's directory holds one)")
    with open(file) as f:
        raw = json.load(f)
    where = f"{file}"
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type={raw['peft_type']!r}; only LoRA adapters are served")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "adapters that save whole modules (modules_to_save) are not supported",
        "fan_in_fan_out": "fan-in-fan-out (Conv1D) weights are not supported",
        "layers_to_transform": "adapters of some layers only (layers_to_transform) are not supported yet",
        "layer_replication": "layer_replication is not supported",
        "target_parameters": "adapted parameters (target_parameters) are not supported",
        "megatron_config": "Megatron-sharded adapters are not supported",
    }
    for field, reason in refused.items():
        if raw.get(field):
            raise ValueError(f"{where}: {field}={raw[field]!r}: {reason}; export the adapter without it")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={raw['bias']!r}: adapters with biases are not supported; use bias='none'")
    targets = lora_targets(config)
    wanted = raw.get("target_modules")
    if isinstance(wanted, str):  # a regular expression over the full module names
        names = sorted({name for name, spec in targets.items() if re.fullmatch(wanted, module_key(spec, 0))})
    elif isinstance(wanted, list) and all(isinstance(w, str) for w in wanted):
        names = [w.rsplit(".", 1)[-1] for w in wanted]
        unknown = sorted(set(names) - set(targets))
        if unknown:
            raise ValueError(
                f"{where}: target_modules {unknown} are not projections a LoRA adapter may adapt in this "
                f"{config.architecture} model ({', '.join(targets)})"
            )
    else:
        raise ValueError(f"{where}: target_modules={wanted!r}: give a list of module names or a regular expression")
    if not names:
        raise ValueError(f"{where}: target_modules={wanted!r} adapts none of {', '.join(targets)}")
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r={rank!r} must be a positive integer")
    return AdapterConfig(
        targets=tuple(name for name in targets if name in names),
        rank=rank,
        alpha=float(alpha),
        use_rslora=bool(raw.get("use_rslora", False)),
        rank_pattern=tuple((k, int(v)) for k, v in (raw.get("rank_pattern") or {}).items()),
        alpha_pattern=tuple((k, float(v)) for k, v in (raw.get("alpha_pattern") or {}).items()),
    )


def module_key(spec: ParamSpec, layer: int) -> str:
    """The checkpoint name of a projection's module in `layer` ("model.layers.0.self_attn.q_proj"):
    what adapter tensors and PEFT's patterns are keyed by."""
    return spec.hf_name.format(layer=layer).removesuffix(".weight")
