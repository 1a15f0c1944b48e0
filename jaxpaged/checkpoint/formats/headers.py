"""What every integer checkpoint format shares: the tensors one linear must store, checked from
the safetensors headers (names, shapes, dtypes) before any data is read, and the unpacking of
codes from int32 words.

Every format packs `32 // bits` codes into one int32 word, the first code in the lowest bits
(`code j` of a word is `(word >> (bits * j)) & (2**bits - 1)`); the formats differ in the axis the
words run along and the order of the codes within a word (AWQ interleaves them).
Dimension letters: I input features, O output features, G groups.
"""

import dataclasses
from collections.abc import Mapping

import numpy as np
from jaxtyping import Int, UInt8

from jaxpaged.config.group_formats import GroupFormat

Header = tuple[tuple[int, ...], str]  # (shape, safetensors dtype) of one stored tensor
FLOAT_DTYPES = ("F16", "BF16", "F32")  # what a scale may be stored as (read as float32)


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor a quantized linear stores.

    Attributes:
      name: its full name in the checkpoint, e.g. `model.layers.0.self_attn.q_proj.qweight`.
      shape: the shape it must have.
      dtypes: the safetensors dtypes it may be stored as.
      layout: what it holds, in words (for errors).
      required: False for a tensor that may be absent (GPTQ's `g_idx` without `desc_act`).
    """

    name: str
    shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    layout: str
    required: bool = True


def per_word(bits: int) -> int:
    """Codes in one int32 word."""
    return 32 // bits


def check_divides(fmt: GroupFormat, prefix: str, num_in: int, num_out: int, packed_axis: str) -> None:
    """Refuses a linear whose input features the group size does not divide, or whose packed
    axis ("in" or "out") is not a whole number of int32 words.

    Raises:
      ValueError: naming the linear, the sizes and the `quantization_config` field.
    """
    if fmt.group_size is not None and num_in % fmt.group_size:
        raise ValueError(
            f"{prefix}: quantization_config group_size={fmt.group_size} does not divide its {num_in} input "
            "features; the checkpoint does not match config.json (or the model cannot be read in groups of that size)"
        )
    size = num_in if packed_axis == "in" else num_out
    if size % per_word(fmt.bits):
        raise ValueError(
            f"{prefix}: its {size} {packed_axis}put features are not a whole number of int32 words of "
            f"{per_word(fmt.bits)} {fmt.bits}-bit codes; the {fmt.method} layout cannot hold this linear"
        )


def check_headers(fmt: GroupFormat, expected: list[StoredTensor], headers: Mapping[str, Header]) -> None:
    """Checks one linear's stored tensors from the headers alone.

    Args:
      fmt: the checkpoint's format (from config.json), named in errors.
      expected: what the linear must store.
      headers: name -> (shape, safetensors dtype) of every tensor in the checkpoint.

    Raises:
      ValueError: naming the first tensor that is missing, misshaped or wrongly typed, what it
        must be, and the fix.
    """
    for t in expected:
        if t.name not in headers:
            if not t.required:
                continue
            raise ValueError(
                f"tensor {t.name!r} is missing: a {fmt.method} checkpoint ({fmt.bits}-bit, group size "
                f"{fmt.group_size or 'all inputs'}) stores {t.layout}; the checkpoint does not match its "
                "config.json's quantization_config"
            )
        shape, dtype = headers[t.name]
        if tuple(shape) != t.shape:
            raise ValueError(
                f"tensor {t.name!r} has shape {list(shape)}, expected {list(t.shape)}: {t.layout} "
                f"({fmt.method}, {fmt.bits}-bit, group size {fmt.group_size or 'all inputs'} from config.json); "
                "a different packing width or group size than config.json's quantization_config says"
            )
        if dtype not in t.dtypes:
            raise ValueError(
                f"tensor {t.name!r} is stored as {dtype}, expected {' or '.join(t.dtypes)}: {t.layout} ({fmt.method})"
            )


def unpack_words(words: Int[np.ndarray, "..."], bits: int, axis: int) -> UInt8[np.ndarray, "..."]:
    """The codes packed in int32 `words`, `32 // bits` per word along `axis`, in storage order:
    code `j` of word `w` lands at index `w * (32 // bits) + j` of that axis."""
    n = per_word(bits)
    moved = np.moveaxis(np.asarray(words).view(np.uint32), axis, -1)
    shifts = np.arange(n, dtype=np.uint32) * np.uint32(bits)
    codes = (moved[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    codes = codes.reshape(*moved.shape[:-1], moved.shape[-1] * n).astype(np.uint8)
    return np.moveaxis(codes, -1, axis)


def contiguous_or(g_idx: Int[np.ndarray, " I"], group_size: int) -> Int[np.ndarray, " I"] | None:
    """None when `g_idx` is the contiguous grouping `i // group_size` (no reordering to do),
    else `g_idx` as int32."""
    g_idx = np.asarray(g_idx, dtype=np.int32)
    return None if np.array_equal(g_idx, np.arange(g_idx.shape[0]) // group_size) else g_idx


def check_g_idx(name: str, g_idx: Int[np.ndarray, " I"], groups: int) -> None:
    """Refuses a stored group index outside `0 .. groups - 1`, naming the tensor."""
    if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
        raise ValueError(
            f"tensor {name!r} holds group indices {int(g_idx.min())}..{int(g_idx.max())}, expected 0..{groups - 1}; "
            "the checkpoint is corrupt or does not match config.json's group_size"
        )
