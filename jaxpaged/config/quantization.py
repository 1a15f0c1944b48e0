"""Quantization options, declared once: the KV cache dtype and the weight quantization methods,
with vLLM's names, and how a pre-quantized checkpoint announces itself. No JAX here.

    kv_cache_dtype   auto (the model's dtype) | fp8 = fp8_e4m3 (float8_e4m3fn) | fp8_e5m2
    quantization     None | fp8 (float8_e4m3fn weights, per output channel; activations
                     quantized per token at run time) | int8 (int8 weights, per output channel;
                     activations stay in the model's dtype) | int4 (4-bit weights rounded to
                     nearest at load, a scale and a zero point per group of
                     `quantization_group_size` input features; activations stay in the model's
                     dtype; see `jaxpaged.model.group_quant`)

Group-quantized methods (`GROUP_QUANT_BITS`) store 4- or 8-bit codes with per-group scales and
zero points; their bits and group size are the model's (`ModelConfig.weight_bits`,
`weight_group_size`, set by `weight_groups`), since they shape its state.

A checkpoint in the compressed-tensors layout (`quantization_config.quant_method` of
"compressed-tensors" with 8-bit float weights) is read as `fp8` without being asked; one in a
4/8-bit integer format (AWQ, GPTQ, compressed-tensors pack-quantized; see `group_formats`) as that
format, whose name `quantization` may give to assert it. A `jaxpaged-convert` directory whose
weights were quantized while converting (`--quantization int4`) records the method, bits and
group size in its config.json (`converted_quantization_config`) and is read as that method, in
those groups, without being asked.
"""

import dataclasses
from typing import Any

from jaxpaged.config.group_formats import (
    GROUP_FORMATS,
    CheckpointQuantizationError,
    GroupFormat,
    awq_format,
    gptq_format,
    is_int_compressed_tensors,
    pack_quantized_format,
)

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
# The dtype each fp8 name stores (JAX/ml_dtypes names).
FP8_KV_DTYPES = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
QUANTIZATION_METHODS = ("fp8", "int8", "int4", *GROUP_FORMATS)
# The dtype each per-channel method stores weights in.
QUANTIZED_WEIGHT_DTYPES = {"fp8": "float8_e4m3fn", "int8": "int8"}
# Group-quantized methods and their bits (a pre-quantized format's come from its config.json).
GROUP_QUANT_BITS = {"int4": 4}
# The dtype group-quantized codes are stored in, by bits (signed: code - 2**(bits-1)), and their
# zero points' and scales' dtypes.
GROUP_CODE_DTYPES = {4: "int4", 8: "int8"}
GROUP_ZERO_DTYPE, GROUP_SCALE_DTYPE = "int8", "float32"
# Input features per group of `--quantization int4` unless `quantization_group_size` says otherwise.
DEFAULT_GROUP_SIZE = 128
# The quant_method of a config.json whose weights jaxpaged-convert quantized itself.
CONVERTED_QUANT_METHOD = "jaxpaged"
# Bytes of one element of every dtype a weight or a KV cache entry may have.
DTYPE_BYTES = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "int4": 0.5,
    "int32": 4,
}


def kv_dtype_name(kv_cache_dtype: str, model_dtype: str) -> str:
    """The dtype the KV cache holds: the model's for "auto", else the fp8 type named."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return FP8_KV_DTYPES[kv_cache_dtype]


def is_fp8(dtype_name: str) -> bool:
    """Whether a dtype name is one of the 8-bit float types."""
    return dtype_name.startswith("float8")


def group_dtypes(bits: int) -> dict[str, str]:
    """The dtype of each array of a group-quantized weight of `bits`, by its role in the model
    state (`jaxpaged.config.params.tables.ROLES`), as stored (`GROUP_CODE_DTYPES`: a CPU holds 4-bit
    codes in int8, `jaxpaged.model.group_quant.code_dtype`)."""
    return {"quant": GROUP_CODE_DTYPES[bits], "scale": GROUP_SCALE_DTYPE, "zero": GROUP_ZERO_DTYPE, "perm": "int32"}


def converted_quantization_config(method: str, group_size: int) -> dict[str, Any]:
    """The `quantization_config` jaxpaged-convert writes into the config.json of a directory whose
    weights it quantized in groups (`method` one of `GROUP_QUANT_BITS`), read back by `converted_format`."""
    return {
        "quant_method": CONVERTED_QUANT_METHOD,
        "method": method,
        "bits": GROUP_QUANT_BITS[method],
        "group_size": group_size,
    }


def converted_format(qc: dict[str, Any]) -> GroupFormat:
    """The groups a `converted_quantization_config` records (asymmetric zero points, contiguous
    groups: `jaxpaged.model.group_quant.quantize_groups`).

    Raises:
      CheckpointQuantizationError: an unknown method, bits other than the method's, or a group
        size that is not a positive integer (naming the field).
    """
    method, bits, size = qc.get("method"), qc.get("bits"), qc.get("group_size")
    if method not in GROUP_QUANT_BITS:
        raise CheckpointQuantizationError(
            f"quantization_config.method={method!r}: jaxpaged-convert quantizes with {', '.join(GROUP_QUANT_BITS)}; "
            "re-run jaxpaged-convert"
        )
    if bits != GROUP_QUANT_BITS[method] or isinstance(bits, bool):
        raise CheckpointQuantizationError(
            f"quantization_config.bits={bits!r}: {method} weights have {GROUP_QUANT_BITS[method]} bits"
        )
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise CheckpointQuantizationError(f"quantization_config.group_size={size!r}: must be a positive integer")
    return GroupFormat(method, bits, size, False, False)


def checkpoint_group_format(hf_config: dict[str, Any]) -> GroupFormat | None:
    """The 4/8-bit integer format a checkpoint's weights are stored in (AWQ, GPTQ,
    compressed-tensors pack-quantized, or the groups jaxpaged-convert quantized them in; from
    config.json's `quantization_config`), or None.

    Raises:
      CheckpointQuantizationError: a variant of those formats that is not read (naming the field).
    """
    qc = hf_config.get("quantization_config") or {}
    method = qc.get("quant_method")
    if method == CONVERTED_QUANT_METHOD:
        return converted_format(qc)
    if method == "awq":
        return awq_format(qc)
    if method == "gptq":
        return gptq_format(qc)
    if method == "compressed-tensors" and is_int_compressed_tensors(qc):
        return pack_quantized_format(qc)
    return None


@dataclasses.dataclass(frozen=True)
class StoredWeights:
    """How a checkpoint's weights are stored, as its config.json says (read with the rest of it,
    once: `EngineConfig.resolve`; the loader takes it from there).

    Attributes:
      quantization: the method they are already quantized with (`checkpoint_quantization`), or
        None for plain weights.
      group_format: their 4/8-bit integer format (`checkpoint_group_format`), or None.
      dtype: the dtype config.json names (`dtype`, or transformers 4's `torch_dtype`); None means
        float32.
    """

    quantization: str | None
    group_format: GroupFormat | None
    dtype: str | None


def stored_weights(hf_config: dict[str, Any]) -> StoredWeights:
    """How the checkpoint whose config.json is `hf_config` stores its weights.

    Raises:
      CheckpointQuantizationError: a `quantization_config` this engine cannot read.
    """
    return StoredWeights(
        checkpoint_quantization(hf_config),
        checkpoint_group_format(hf_config),
        hf_config.get("dtype") or hf_config.get("torch_dtype"),
    )


def checkpoint_quantization(hf_config: dict[str, Any]) -> str | None:
    """The method a checkpoint's weights are already quantized with (from its config.json), or
    None for plain weights.

    Read are: the 4/8-bit integer formats (`checkpoint_group_format`; the method is the format's
    name, "awq", "gptq" or "compressed-tensors", or "int4" in a jaxpaged-convert directory), and compressed-tensors 8-bit float weights (the
    layout of the public FP8 Llama checkpoints: `weight` in float8_e4m3fn and `weight_scale` per
    tensor or per output channel; the method is "fp8").

    Raises:
      CheckpointQuantizationError: any other `quantization_config` (naming the field).
    """
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    group = checkpoint_group_format(hf_config)
    if group is not None:
        return group.method
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise CheckpointQuantizationError(
            f"quantization_config.quant_method={method!r} is not supported; jaxpaged reads awq, gptq and "
            "compressed-tensors checkpoints, or quantizes plain bfloat16/float32 weights itself (quantization fp8 or "
            "int8)"
        )
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise CheckpointQuantizationError(
                f"quantization_config.config_groups.{name}.weights={weights!r}: only 8-bit float weights "
                "(compressed-tensors FP8) and 4/8-bit integer ones (pack-quantized) are supported"
            )
        if weights.get("strategy") not in ("tensor", "channel"):
            raise CheckpointQuantizationError(
                f"quantization_config.config_groups.{name}.weights.strategy={weights.get('strategy')!r}: only "
                "'tensor' and 'channel' weight scales are supported"
            )
    return "fp8"


def weight_groups(
    quantization: str | None, group_size: int = DEFAULT_GROUP_SIZE, hf_config: dict[str, Any] | None = None
) -> tuple[int, int | None] | None:
    """`(bits, group_size)` of a group-quantized method's weights (None for the others), for
    `ModelConfig.with_weight_groups`.

    Args:
      quantization: the resolved method (`resolve_quantization`).
      group_size: input features per group for a method quantized at load (the
        `quantization_group_size` option).
      hf_config: config.json, whose `quantization_config` gives a pre-quantized format's bits
        and group size (None: one group per output channel), or those jaxpaged-convert
        quantized the weights with.

    Raises:
      ValueError: `group_size` given (not the default) for weights jaxpaged-convert quantized in
        groups of another size (naming both).
    """
    stored = checkpoint_group_format(hf_config or {})
    if stored is not None and stored.method == quantization:
        if quantization in GROUP_QUANT_BITS and group_size not in (DEFAULT_GROUP_SIZE, stored.group_size):
            raise ValueError(
                f"quantization_group_size={group_size}: the weights were quantized in groups of {stored.group_size} "
                f"by jaxpaged-convert (config.json's quantization_config); leave it unset or give {stored.group_size}"
            )
        return stored.bits, stored.group_size
    if quantization not in GROUP_QUANT_BITS:
        return None
    return GROUP_QUANT_BITS[quantization], group_size


def group_size_field(quantization: str | None) -> str:
    """Where the group size of `quantization`'s weights comes from (for errors)."""
    return "quantization_config.group_size" if quantization in GROUP_FORMATS else "quantization_group_size"


def resolve_quantization(requested: str | None, hf_config: dict[str, Any]) -> str | None:
    """The weight quantization an engine runs with: the checkpoint's, else the one requested.

    A checkpoint format's name ("awq", "gptq", "compressed-tensors", as vLLM's `--quantization`
    takes them) asserts that the checkpoint is stored so; "compressed-tensors" also names a
    compressed-tensors FP8 checkpoint (read as "fp8").

    Raises:
      ValueError: a pre-quantized checkpoint and a different method requested, or a format named
        for a checkpoint that is not stored in it (names both).
    """
    stored = checkpoint_quantization(hf_config)
    accepted = {None, stored}
    if stored == "fp8":
        accepted.add("compressed-tensors")
    if stored is not None and requested not in accepted:
        raise ValueError(
            f"quantization={requested!r}: the checkpoint is already quantized as {stored!r} "
            f"(its config.json says so); leave quantization unset or give {stored!r}"
        )
    if stored is None and requested in GROUP_FORMATS:
        raise ValueError(
            f"quantization={requested!r}: names a pre-quantized {requested} checkpoint, but config.json has no "
            "quantization_config; leave quantization unset, or quantize at load (fp8, int8, int4)"
        )
    return stored or requested
