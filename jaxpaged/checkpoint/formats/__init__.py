"""Readers of the 4/8-bit integer checkpoint formats: each turns one Hugging Face linear's stored
tensors into one `GroupQuantized` (see `jaxpaged.checkpoint.group_quant`).

Every format module (`awq`, `gptq`, `pack_quantized`; its docstring states the exact layout) has

    stored_tensors(fmt, prefix, num_in, num_out) -> [StoredTensor]   what linear `prefix` stores
    unpack(fmt, prefix, tensors, num_in) -> GroupQuantized           from that linear's arrays

`check_linears` checks every linear's stored tensors from the headers alone, before any data is
read; `linear_reader` then reads and unpacks them one linear at a time, in the one group size the
model holds.

`prefix` is the linear's name without `.weight` (e.g. `model.layers.0.self_attn.q_proj`);
`num_in`, `num_out` its input and output features (the HF weight is `[num_out, num_in]`).
"""

import types
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from jaxpaged.checkpoint.formats import awq, gptq, pack_quantized
from jaxpaged.checkpoint.formats.headers import Header, check_headers
from jaxpaged.checkpoint.group_quant import GroupQuantized
from jaxpaged.checkpoint.safetensors_index import SafetensorsCheckpoint
from jaxpaged.config.group_formats import GroupFormat
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.tables import linear_prefixes, param_specs

READERS: dict[str, types.ModuleType] = {"awq": awq, "gptq": gptq, "compressed-tensors": pack_quantized}

Linear = tuple[str, int, int]  # (prefix, num_in, num_out)


def quantized_linears(config: ModelConfig) -> list[Linear]:
    """`(prefix, num_in, num_out)` of every linear a quantized checkpoint of `config` stores as
    integer codes (the decoder layers' projections, each expert's its own, but those of
    `config.float_weights`), layer by layer; a fused linear once, with all its outputs."""
    specs = [p for p in param_specs(config) if p.quantize]
    linears: dict[str, Linear] = {}
    for layer in range(config.num_layers):
        for spec in specs:
            num_out, num_in = spec.hf_shape(config)
            linears.update({prefix: (prefix, num_in, num_out) for prefix in linear_prefixes(spec, config, layer)})
    return list(linears.values())


def reader(fmt: GroupFormat) -> types.ModuleType:
    """The module that reads `fmt.method`'s layout."""
    return READERS[fmt.method]


def check_linears(fmt: GroupFormat, linears: Iterable[Linear], headers: Mapping[str, Header]) -> list[str]:
    """Checks every quantized linear from the headers alone, before any data is read.

    Args:
      fmt: the checkpoint's format (`jaxpaged.config.group_formats`).
      linears: `(prefix, num_in, num_out)` of every quantized linear.
      headers: name -> (shape, safetensors dtype) of every tensor in the checkpoint.

    Returns:
      The names of the tensors the linears store that are present (to read, and to count as
      expected when the loader checks for unexpected tensors).

    Raises:
      ValueError: naming the first tensor that is missing, misshaped or wrongly typed (a linear
        stored in float that `fmt.not_converted` does not leave out: its missing codes).
    """
    module = reader(fmt)
    names = []
    for prefix, num_in, num_out in linears:
        expected = module.stored_tensors(fmt, prefix, num_in, num_out)
        if expected[0].name not in headers and f"{prefix}.weight" in headers:
            raise ValueError(
                f"tensor {expected[0].name!r} is missing: {prefix} is stored in float ({prefix}.weight), but "
                f"config.json's quantization_config does not leave it unquantized ({fmt.not_converted_field}="
                f"{list(fmt.not_converted)}); list the module there, in every layer and expert alike"
            )
        check_headers(fmt, expected, headers)
        names += [t.name for t in expected if t.name in headers]
    return names


def regroup(gq: GroupQuantized, group_size: int) -> GroupQuantized:
    """The same weight in contiguous groups of `group_size` (dividing `gq.group_size`): each
    group's scale and zero point repeated over the smaller groups it splits into."""
    assert gq.g_idx is None and gq.group_size % group_size == 0, (gq.group_size, group_size)
    repeat = gq.group_size // group_size
    scale, zero = np.repeat(gq.scale, repeat, axis=0), np.repeat(gq.zero, repeat, axis=0)
    return GroupQuantized(gq.q, scale, zero, None, gq.bits, group_size)


def linear_reader(
    fmt: GroupFormat, linears: list[Linear], ckpt: SafetensorsCheckpoint, group_size: int
) -> tuple[list[str], Callable[[str], GroupQuantized]]:
    """Checks every linear's stored tensors from the headers (`check_linears`), then reads them
    one linear at a time, in contiguous groups of `group_size` (the model's
    `weight_group_size`: the format's, or for one group per output channel a size dividing every
    linear's inputs, see `ModelConfig.with_weight_groups`; `regroup` repeats each channel's
    scale and zero point over them).

    Returns:
      `(names, read_linear)`: the tensors the linears store (the loader counts them as expected),
      and the function from a linear's prefix to its `GroupQuantized` (read from the files when
      called).

    Raises:
      ValueError: as `check_linears`; `read_linear` as the format's `unpack`.
    """
    module = reader(fmt)
    names = check_linears(fmt, linears, {n: (ckpt.shape(n), ckpt.dtype(n)) for n in ckpt.names})
    sizes = {prefix: (num_in, num_out) for prefix, num_in, num_out in linears}

    def read_linear(prefix: str) -> GroupQuantized:
        num_in, num_out = sizes[prefix]
        stored = [t.name for t in module.stored_tensors(fmt, prefix, num_in, num_out) if t.name in ckpt.locations]
        gq = module.unpack(fmt, prefix, dict(ckpt.iter_tensors(stored)), num_in)
        return gq if gq.group_size == group_size else regroup(gq, group_size)

    return names, read_linear
