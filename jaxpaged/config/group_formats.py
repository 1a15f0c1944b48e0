"""The 4/8-bit integer checkpoint formats, read from config.json's `quantization_config` (no JAX,
no tensors: what the file announces; `jaxpaged.checkpoint.formats` reads the tensors).

    quant_method        fields read (others ignored)                  accepted
    awq                 bits | w_bit, group_size | q_group_size,       bits 4, version "gemm",
                        zero_point, version, modules_to_not_convert   zero_point true; a projection
                                                                      left out in every layer and
                                                                      expert or in none
    gptq                bits, group_size, desc_act, sym,              bits 4 or 8, checkpoint_format
                        checkpoint_format, lm_head, dynamic           "gptq" (v1), lm_head false, no dynamic
    compressed-tensors  format (top level or per config group),       format "pack-quantized", weights
                        config_groups.*.weights, .input_activations,  type "int", 4 or 8 bits, strategy
                        ignore                                        "group" or "channel", no activations;
                                                                      a projection ignored in every layer
                                                                      and expert or in none

A group size of -1 (or a "channel" strategy) is one group spanning every input feature.
"""

import dataclasses
import re
from typing import Any

GROUP_FORMATS = ("awq", "gptq", "compressed-tensors")
GROUP_BITS = (4, 8)
PACK_QUANTIZED = "pack-quantized"  # compressed-tensors' name for integer codes packed into int32


class CheckpointQuantizationError(ValueError):
    """A checkpoint's `quantization_config` this engine cannot read (names the field and value)."""


@dataclasses.dataclass(frozen=True)
class GroupFormat:
    """How a checkpoint's linear weights are stored as integer codes in groups of input features.

    Attributes:
      method: one of `GROUP_FORMATS` (the checkpoint's `quant_method`), or the method
        `jaxpaged-convert` quantized a plain checkpoint with ("int4", see
        `jaxpaged.config.quantization.converted_format`).
      bits: bits per code, 4 or 8.
      group_size: input features per group, or None for one group spanning all inputs.
      sym: symmetric codes (the zero point is the middle code, `2**(bits-1)`).
      act_order: each linear stores the group of every input feature (GPTQ `desc_act`,
        compressed-tensors `actorder: group`); else groups are contiguous.
      not_converted: the modules left in float, as the format names them (`leaves_float` says
        how they match a module): AWQ's `modules_to_not_convert` (e.g. Mixtral's routers,
        `gate`), compressed-tensors' `ignore` (e.g. `lm_head`, `re:.*mlp.gate$`). The
        projections left in float in every layer and expert are the model's `float_weights`
        (`jaxpaged.config.params.tables.float_weights`).
    """

    method: str
    bits: int
    group_size: int | None
    sym: bool
    act_order: bool
    not_converted: tuple[str, ...] = ()

    @property
    def not_converted_field(self) -> str:
        """The `quantization_config` field `not_converted` comes from."""
        return "ignore" if self.method == "compressed-tensors" else "modules_to_not_convert"

    def leaves_float(self, module: str) -> bool:
        """Whether the format leaves `module` (e.g. `model.layers.0.mlp.gate_proj`) in float. AWQ
        matches a name as a substring of the module's, as AutoAWQ and transformers do;
        compressed-tensors matches it whole, or as a regular expression from the module name's
        start after `re:`, as compressed-tensors does."""
        if self.method != "compressed-tensors":
            return any(name in module for name in self.not_converted)
        return any(
            re.match(name[3:], module) is not None if name.startswith("re:") else name == module
            for name in self.not_converted
        )

    def groups(self, num_in: int) -> int:
        """Groups of a linear with `num_in` input features."""
        return 1 if self.group_size is None else num_in // self.group_size


def _field(qc: dict[str, Any], *names: str, default: Any = None) -> tuple[str, Any]:
    """`(name, value)` of the first of `names` present in `qc` (the first name and `default`
    when none is)."""
    for name in names:
        if name in qc:
            return name, qc[name]
    return names[0], default


def _refuse(field: str, value: Any, why: str) -> CheckpointQuantizationError:
    return CheckpointQuantizationError(f"quantization_config.{field}={value!r}: {why}")


def _group_size(field: str, value: Any) -> int | None:
    if value == -1:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _refuse(field, value, "the group size must be a positive integer or -1 (one group per output channel)")
    return value


def _bits(field: str, value: Any, allowed: tuple[int, ...]) -> int:
    if value not in allowed or isinstance(value, bool):
        raise _refuse(field, value, f"jaxpaged reads {' or '.join(map(str, allowed))}-bit weights of this format")
    return value


def _flag(qc: dict[str, Any], field: str, default: bool) -> bool:
    value = qc.get(field, default)
    if not isinstance(value, bool):
        raise _refuse(field, value, "must be true or false")
    return value


def awq_format(qc: dict[str, Any]) -> GroupFormat:
    """The AWQ GEMM layout a `quant_method: awq` config announces.

    Raises:
      CheckpointQuantizationError: another version (GEMV, Marlin, ...), other bits, no zero
        points, or a `modules_to_not_convert` that is not a list of names.
    """
    bits_field, bits = _field(qc, "bits", "w_bit")
    size_field, size = _field(qc, "group_size", "q_group_size")
    version = qc.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise _refuse("version", version, "only AutoAWQ's GEMM layout is read; re-save the model with version 'gemm'")
    if not _flag(qc, "zero_point", True):
        raise _refuse("zero_point", False, "AWQ's GEMM layout stores zero points (qzeros); symmetric AWQ is not read")
    not_converted = qc.get("modules_to_not_convert") or []
    if not isinstance(not_converted, list) or not all(isinstance(name, str) and name for name in not_converted):
        raise _refuse("modules_to_not_convert", not_converted, "must be a list of module names")
    bits = _bits(bits_field, bits, (4,))
    return GroupFormat("awq", bits, _group_size(size_field, size), False, False, tuple(not_converted))


def gptq_format(qc: dict[str, Any]) -> GroupFormat:
    """The GPTQ v1 layout a `quant_method: gptq` config announces.

    Raises:
      CheckpointQuantizationError: the v2 or Marlin checkpoint formats, bits other than 4 or 8,
        a quantized lm_head, or per-module overrides (`dynamic`).
    """
    checkpoint_format = qc.get("checkpoint_format", "gptq")
    if checkpoint_format != "gptq":
        raise _refuse(
            "checkpoint_format",
            checkpoint_format,
            "only the v1 'gptq' format (zero points stored minus one) is read; save the model with "
            "checkpoint_format 'gptq'",
        )
    if qc.get("lm_head"):
        raise _refuse("lm_head", qc["lm_head"], "a quantized LM head is not read; quantize the decoder layers only")
    if qc.get("dynamic"):
        raise _refuse("dynamic", qc["dynamic"], "per-module overrides are not read; quantize every layer alike")
    return GroupFormat(
        "gptq",
        _bits("bits", qc.get("bits"), GROUP_BITS),
        _group_size("group_size", qc.get("group_size", -1)),
        _flag(qc, "sym", True),
        _flag(qc, "desc_act", False),
    )


def pack_quantized_format(qc: dict[str, Any]) -> GroupFormat:
    """The compressed-tensors `pack-quantized` layout (W4A16 / W8A16) a config announces.

    Raises:
      CheckpointQuantizationError: another format, non-integer weights, a strategy other than
        group or channel, quantized activations, or config groups that differ.
    """
    formats = set()
    found = set()
    for name, group in (qc.get("config_groups") or {}).items():
        where = f"config_groups.{name}"
        weights = group.get("weights") or {}
        formats.add(group.get("format") or qc.get("format"))
        if weights.get("type") != "int":
            raise _refuse(f"{where}.weights.type", weights.get("type"), "pack-quantized weights must be 'int'")
        if group.get("input_activations"):
            raise _refuse(
                f"{where}.input_activations",
                group["input_activations"],
                "quantized activations (W4A8, W8A8) are not read; only weight-only schemes (W4A16, W8A16)",
            )
        strategy = weights.get("strategy")
        if strategy == "group":
            size = _group_size(f"{where}.weights.group_size", weights.get("group_size"))
        elif strategy == "channel":
            size = None
        else:
            raise _refuse(f"{where}.weights.strategy", strategy, "only 'group' and 'channel' integer weights are read")
        actorder = weights.get("actorder")
        if actorder not in (None, False, True, "group", "dynamic", "weight", "static"):
            raise _refuse(f"{where}.weights.actorder", actorder, "must be null, 'group' or 'weight'")
        symmetric = weights.get("symmetric", True)
        found.add(
            GroupFormat(
                "compressed-tensors",
                _bits(f"{where}.weights.num_bits", weights.get("num_bits"), GROUP_BITS),
                size,
                bool(symmetric),
                # "weight" order permutes the weight only: groups stay contiguous, no g_idx stored
                size is not None and actorder in (True, "group", "dynamic"),
            )
        )
    if formats != {PACK_QUANTIZED}:
        raise _refuse("format", sorted(map(str, formats)), f"integer weights are read in the {PACK_QUANTIZED!r} format")
    if len(found) != 1:
        raise _refuse("config_groups", sorted(qc.get("config_groups") or {}), "every group must quantize alike")
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(name, str) and name for name in ignore):
        raise _refuse("ignore", ignore, "must be a list of module names (or 're:' regular expressions)")
    for name in ignore:
        if name.startswith("re:"):
            try:
                re.compile(name[3:])
            except re.error as err:
                raise _refuse("ignore", name, f"is not a regular expression ({err})") from None
    return dataclasses.replace(found.pop(), not_converted=tuple(ignore))


def is_int_compressed_tensors(qc: dict[str, Any]) -> bool:
    """Whether a compressed-tensors config quantizes weights to integers (else: to floats)."""
    return any(((g or {}).get("weights") or {}).get("type") == "int" for g in (qc.get("config_groups") or {}).values())
