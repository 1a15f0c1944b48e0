"""compressed-tensors' `pack-quantized` layout (`quant_method: compressed-tensors`, integer
weights: llm-compressor's W4A16 / W8A16 schemes, group or channel strategy, symmetric or not),
as its `PackedQuantizationCompressor` writes it.

One linear `<prefix>` (I inputs, O outputs, group size S, G = I / S, or G = 1 for the channel
strategy; P = 32 / bits codes per word) stores, outputs first like the HF weight it replaces:

    weight_packed      int32          [O, I / P]  codes packed along the INPUT features, in
                                                  order (code j of word c is input P*c + j)
    weight_scale       float16/bf16   [O, G]      (float32 accepted)
    weight_shape       int32/int64    [2]         the unpacked shape, [O, I]
    weight_zero_point  int32          [O / P, G]  only when not symmetric: zero-point codes
                                                  packed along the OUTPUT features, in order
    weight_g_idx       int32          [I]         only with `actorder: group`: each input's group

Codes are signed values `v` in `-2**(bits-1) .. 2**(bits-1) - 1` stored offset by `2**(bits-1)`
(unsigned `u = v + 2**(bits-1)`); zero points likewise. The weight is `(v - zp) * scale`, which
in the stored unsigned codes is

    w[o, i] = (u[o, i] - zu[o, g[i]]) * weight_scale[o, g[i]],   zu = 2**(bits-1) when symmetric

(`actorder: weight` permutes only while quantizing: groups stay contiguous and no g_idx is stored.)
"""

from collections.abc import Mapping

import numpy as np

from jaxpaged.checkpoint.formats.headers import (
    FLOAT_DTYPES,
    StoredTensor,
    check_divides,
    check_g_idx,
    contiguous_or,
    per_word,
    unpack_words,
)
from jaxpaged.checkpoint.group_quant import GroupQuantized
from jaxpaged.config.group_formats import GroupFormat


def stored_tensors(fmt: GroupFormat, prefix: str, num_in: int, num_out: int) -> list[StoredTensor]:
    """The tensors linear `prefix` (`num_in` inputs, `num_out` outputs) stores.

    Raises:
      ValueError: the group size does not divide `num_in`, or `num_in` (or `num_out`, for packed
        zero points) is not a whole number of words.
    """
    check_divides(fmt, prefix, num_in, num_out, packed_axis="in")
    n, groups = per_word(fmt.bits), fmt.groups(num_in)
    expected = [
        StoredTensor(
            f"{prefix}.weight_packed",
            (num_out, num_in // n),
            ("I32",),
            f"weight_packed [out, in/{n}]: int32 words of {n} {fmt.bits}-bit codes along the inputs",
        ),
        StoredTensor(f"{prefix}.weight_scale", (num_out, groups), FLOAT_DTYPES, f"weight_scale [out, {groups} groups]"),
        StoredTensor(f"{prefix}.weight_shape", (2,), ("I32", "I64"), "weight_shape [2]: the unpacked [out, in]"),
    ]
    if not fmt.sym:
        check_divides(fmt, prefix, num_in, num_out, packed_axis="out")
        expected.append(
            StoredTensor(
                f"{prefix}.weight_zero_point",
                (num_out // n, groups),
                ("I32",),
                f"weight_zero_point [out/{n}, groups]: zero points packed along the outputs (symmetric: false)",
            )
        )
    if fmt.act_order:
        expected.append(
            StoredTensor(f"{prefix}.weight_g_idx", (num_in,), ("I32",), "weight_g_idx [in]: each input's group")
        )
    return expected


def unpack(fmt: GroupFormat, prefix: str, tensors: Mapping[str, np.ndarray], num_in: int) -> GroupQuantized:
    """Linear `prefix`'s stored tensors (checked by `check_linears`) -> its codes, scales and zeros.

    Raises:
      ValueError: naming `weight_shape` when it is not the linear's `[out, in]`, or
        `weight_g_idx` holding groups out of range.
    """
    packed = tensors[f"{prefix}.weight_packed"]
    num_out = packed.shape[0]
    shape = [int(x) for x in np.asarray(tensors[f"{prefix}.weight_shape"]).reshape(-1)]
    if shape != [num_out, num_in]:
        raise ValueError(
            f"tensor {prefix + '.weight_shape'!r} says {shape}, but the linear is [{num_out}, {num_in}] (config.json)"
        )
    group_size = fmt.group_size or num_in
    q = unpack_words(packed, fmt.bits, axis=1).T
    scale = np.asarray(tensors[f"{prefix}.weight_scale"], dtype=np.float32).T
    if fmt.sym:
        zero = np.full(scale.shape, 1 << (fmt.bits - 1), np.uint8)
    else:
        zero = unpack_words(tensors[f"{prefix}.weight_zero_point"], fmt.bits, axis=0).T
    g_idx = None
    name = f"{prefix}.weight_g_idx"
    if fmt.act_order:
        check_g_idx(name, tensors[name], scale.shape[0])
        g_idx = contiguous_or(tensors[name], group_size)
    return GroupQuantized(np.ascontiguousarray(q), np.ascontiguousarray(scale), zero, g_idx, fmt.bits, group_size)
