"""AutoAWQ's GEMM layout (`quant_method: awq`, `version: gemm`), 4-bit codes with zero points.

One linear `<prefix>` (a Hugging Face `nn.Linear` of I inputs and O outputs, group size S, G = I / S)
stores, as AutoAWQ's `WQLinear_GEMM` writes it:

    qweight  int32    [I, O / 8]  eight 4-bit codes per word along the OUTPUT features
    qzeros   int32    [G, O / 8]  the zero-point codes, packed exactly like qweight
    scales   float16  [G, O]      (bfloat16 / float32 accepted)
    bias     float16  [O]         optional, an ordinary tensor the loader reads like any bias

Within a word the codes are interleaved: the code in bits 4j..4j+3 of word c belongs to output
feature 8c + ORDER[j] with ORDER = (0, 2, 4, 6, 1, 3, 5, 7) (the order AWQ's CUDA kernel unpacks
pairs in). Zero points are stored as they are (no offset), so

    w[i, o] = (qweight_code[i, o] - qzeros_code[i // S, o]) * scales[i // S, o]

A group size of -1 in the config means one group over all I inputs (G = 1).
"""

from collections.abc import Mapping

import numpy as np

from jaxpaged.checkpoint.formats.headers import (
    FLOAT_DTYPES,
    StoredTensor,
    check_divides,
    per_word,
    unpack_words,
)
from jaxpaged.checkpoint.group_quant import GroupQuantized
from jaxpaged.config.group_formats import GroupFormat

# Output feature (within its word's eight) of the code in each 4-bit slot of a word, lowest first.
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def stored_tensors(fmt: GroupFormat, prefix: str, num_in: int, num_out: int) -> list[StoredTensor]:
    """The tensors linear `prefix` (`num_in` inputs, `num_out` outputs) stores.

    Raises:
      ValueError: the group size does not divide `num_in`, or `num_out` is not a multiple of 8.
    """
    check_divides(fmt, prefix, num_in, num_out, packed_axis="out")
    words, groups = num_out // per_word(fmt.bits), fmt.groups(num_in)
    packed = "int32 words of eight 4-bit codes along the outputs in AWQ's order 0,2,4,6,1,3,5,7"
    return [
        StoredTensor(f"{prefix}.qweight", (num_in, words), ("I32",), f"qweight [in, out/8]: {packed}"),
        StoredTensor(f"{prefix}.qzeros", (groups, words), ("I32",), f"qzeros [groups, out/8]: zero points, {packed}"),
        StoredTensor(f"{prefix}.scales", (groups, num_out), FLOAT_DTYPES, "scales [groups, out]: one per group"),
    ]


def _natural_order(codes: np.ndarray) -> np.ndarray:
    """Codes unpacked in storage order `[rows, O]` -> in output-feature order."""
    rows, num_out = codes.shape
    slots = codes.reshape(rows, num_out // len(ORDER), len(ORDER))
    return slots[:, :, np.argsort(ORDER)].reshape(rows, num_out)


def unpack(fmt: GroupFormat, prefix: str, tensors: Mapping[str, np.ndarray], num_in: int) -> GroupQuantized:
    """Linear `prefix`'s stored tensors (checked by `check_linears`) -> its codes, scales and zeros."""
    q = _natural_order(unpack_words(tensors[f"{prefix}.qweight"], fmt.bits, axis=1))
    zero = _natural_order(unpack_words(tensors[f"{prefix}.qzeros"], fmt.bits, axis=1))
    scale = np.asarray(tensors[f"{prefix}.scales"], dtype=np.float32)
    return GroupQuantized(q, scale, zero, None, fmt.bits, fmt.group_size or num_in)
