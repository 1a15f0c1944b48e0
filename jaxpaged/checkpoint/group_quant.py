"""One linear layer's weight quantized to 4 or 8 bits in groups along its input features, as the
checkpoint readers (AWQ, GPTQ, compressed-tensors pack-quantized) and the round-to-nearest
quantizer hand it to the loader: unpacked numpy codes in the Hugging Face linear's features, before
anything reaches the device. Every format is reduced to this one meaning:

    w[i, o] = (q[i, o] - zero[g[i], o]) * scale[g[i], o],   g = g_idx, or g[i] = i // group_size

Dimension letters: I input features, O output features, G groups (ceil(I / group_size)).
"""

import dataclasses

import numpy as np
from jaxtyping import Float, Int, UInt8

QUANT_BITS = (4, 8)


@dataclasses.dataclass(frozen=True)
class GroupQuantized:
    """A group-quantized linear weight.

    Attributes:
      q: `[I, O]` uint8 codes in `0 .. 2**bits - 1`.
      scale: `[G, O]` float32 scales.
      zero: `[G, O]` uint8 zero-point codes (a symmetric format's is `2**(bits-1)` everywhere).
      g_idx: `[I]` int32 group of each input feature (GPTQ with `desc_act`), or None for
        contiguous groups (`i // group_size`).
      bits: 4 or 8.
      group_size: input features per group (I for one group per output channel).
    """

    q: UInt8[np.ndarray, "I O"]
    scale: Float[np.ndarray, "G O"]
    zero: UInt8[np.ndarray, "G O"]
    g_idx: Int[np.ndarray, " I"] | None
    bits: int
    group_size: int

    def __post_init__(self):
        num_in, num_out = self.q.shape
        groups = -(-num_in // self.group_size)
        if self.bits not in QUANT_BITS:
            raise ValueError(f"bits={self.bits}: group-quantized weights have 4 or 8 bits")
        if self.scale.shape != (groups, num_out) or self.zero.shape != (groups, num_out):
            raise ValueError(
                f"scale {self.scale.shape} and zero {self.zero.shape} must both be {(groups, num_out)} for "
                f"q {self.q.shape} with group_size {self.group_size}"
            )
        if self.g_idx is not None and self.g_idx.shape != (num_in,):
            raise ValueError(f"g_idx {self.g_idx.shape} must be ({num_in},) for q {self.q.shape}")

    def groups(self) -> Int[np.ndarray, " I"]:
        """The group of every input feature."""
        if self.g_idx is not None:
            return self.g_idx
        return np.arange(self.q.shape[0]) // self.group_size

    def outputs(self, start: int, stop: int) -> "GroupQuantized":
        """The weight of output features `start:stop` only (one part of a fused linear)."""
        cut = slice(start, stop)
        return GroupQuantized(
            self.q[:, cut], self.scale[:, cut], self.zero[:, cut], self.g_idx, self.bits, self.group_size
        )

    def dequantize(self) -> Float[np.ndarray, "I O"]:
        """The float32 weight `[I, O]` the codes stand for (the reference every format is tested against)."""
        g = self.groups()
        return (self.q.astype(np.float32) - self.zero[g].astype(np.float32)) * self.scale[g].astype(np.float32)
