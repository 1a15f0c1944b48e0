"""The GPTQ v1 layout (`quant_method: gptq`, `checkpoint_format: gptq`), as AutoGPTQ's
`QuantLinear` and gptqmodel's v1 export write it: 4 or 8 bits, symmetric or not, with or without
`desc_act` (activation order).

One linear `<prefix>` (I inputs, O outputs, group size S, G = I / S; P = 32 / bits codes per word)
stores:

    qweight  int32    [I / P, O]  codes packed along the INPUT features, in order: code j of
                                  word r is input feature P*r + j (bits `bits*j` upwards)
    qzeros   int32    [G, O / P]  zero-point codes packed along the OUTPUT features, in order,
                                  each stored MINUS ONE (the v1 off-by-one)
    scales   float16  [G, O]      (bfloat16 / float32 accepted)
    g_idx    int32    [I]         the group of every input feature; required with desc_act, where
                                  it is the grouping of a permutation (input features are stored
                                  in their original order, groups formed in activation order);
                                  without desc_act it may be absent and must be i // S if present
    bias     float16  [O]         optional, an ordinary tensor the loader reads like any bias

    w[i, o] = (qweight_code[i, o] - (qzeros_code[g_idx[i], o] + 1)) * scales[g_idx[i], o]

The +1 is applied as AutoGPTQ's dequantizer applies it, after masking the field: a stored field
of all ones (what the v1 packer writes for a zero point of 0, its -1 overflowing) reads as
`2**bits`, the value its own kernels use (4 bits: 16; 8 bits: 256, which a uint8 zero point
cannot hold, so such an 8-bit file is refused naming `qzeros`). With `sym` every zero point must be `2**(bits-1)`
(stored `2**(bits-1) - 1`); a file whose zeros say otherwise is refused. A group size of -1 is one
group over all I inputs.
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

V1_ZERO_OFFSET = 1  # a v1 file stores each zero point minus this


def stored_tensors(fmt: GroupFormat, prefix: str, num_in: int, num_out: int) -> list[StoredTensor]:
    """The tensors linear `prefix` (`num_in` inputs, `num_out` outputs) stores.

    Raises:
      ValueError: the group size does not divide `num_in`, or `num_in` / `num_out` is not a
        whole number of words.
    """
    check_divides(fmt, prefix, num_in, num_out, packed_axis="in")
    check_divides(fmt, prefix, num_in, num_out, packed_axis="out")
    n, groups = per_word(fmt.bits), fmt.groups(num_in)
    return [
        StoredTensor(
            f"{prefix}.qweight",
            (num_in // n, num_out),
            ("I32",),
            f"qweight [in/{n}, out]: int32 words of {n} {fmt.bits}-bit codes along the inputs",
        ),
        StoredTensor(
            f"{prefix}.qzeros",
            (groups, num_out // n),
            ("I32",),
            f"qzeros [groups, out/{n}]: zero points minus one, {n} per int32 word along the outputs",
        ),
        StoredTensor(f"{prefix}.scales", (groups, num_out), FLOAT_DTYPES, "scales [groups, out]: one per group"),
        StoredTensor(
            f"{prefix}.g_idx",
            (num_in,),
            ("I32",),
            "g_idx [in]: the group of every input feature (desc_act)",
            required=fmt.act_order,
        ),
    ]


def unpack(fmt: GroupFormat, prefix: str, tensors: Mapping[str, np.ndarray], num_in: int) -> GroupQuantized:
    """Linear `prefix`'s stored tensors (checked by `check_linears`) -> its codes, scales and zeros.

    Raises:
      ValueError: naming `g_idx` (out of range, or not contiguous without desc_act) or `qzeros`
        (not the middle code under `sym`).
    """
    group_size = fmt.group_size or num_in
    q = unpack_words(tensors[f"{prefix}.qweight"], fmt.bits, axis=0)
    zero = unpack_words(tensors[f"{prefix}.qzeros"], fmt.bits, axis=1).astype(np.int32) + V1_ZERO_OFFSET
    scale = np.asarray(tensors[f"{prefix}.scales"], dtype=np.float32)
    if zero.max() > np.iinfo(np.uint8).max:
        raise ValueError(
            f"tensor {prefix + '.qzeros'!r} stores -1 for an 8-bit zero point (a zero point of 0 that the v1 "
            "packer cannot write: the field overflowed); re-export the model (gptqmodel, checkpoint_format 'gptq') "
            "or quantize it symmetrically"
        )
    if fmt.sym and np.any(zero != 1 << (fmt.bits - 1)):
        raise ValueError(
            f"tensor {prefix + '.qzeros'!r} holds zero points other than {1 << (fmt.bits - 1)} but config.json says "
            "sym=true; the checkpoint does not match its quantization_config (set sym false if it is asymmetric)"
        )
    g_idx = None
    name = f"{prefix}.g_idx"
    if name in tensors:
        g_idx = contiguous_or(tensors[name], group_size)
        check_g_idx(name, tensors[name], scale.shape[0])
        if g_idx is not None and not fmt.act_order:
            raise ValueError(
                f"tensor {name!r} reorders the input features into groups but config.json says desc_act=false; "
                "the checkpoint does not match its quantization_config (set desc_act true)"
            )
    return GroupQuantized(q, scale, zero.astype(np.uint8), g_idx, fmt.bits, group_size)
