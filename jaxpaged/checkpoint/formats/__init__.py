"""Readers of the 4/8-bit integer checkpoint formats: each turns one Hugging Face linear's stored
tensors into one `GroupQuantized` (see `jaxpaged.checkpoint.group_quant`).

Every format module (`awq`, `gptq`, `pack_quantized`; its docstring states the exact layout) has

    stored_tensors(fmt, prefix, num_in, num_out) -> [StoredTensor]   what linear `prefix` stores
    unpack(fmt, prefix, tensors, num_in) -> GroupQuantized           from that linear's arrays

`check_linears` checks every linear's stored tensors from the headers alone, before any data is
read; `read_linears` then unpacks them one linear at a time.

`prefix` is the linear's name without `.weight` (e.g. `model.layers.0.self_attn.q_proj`);
`num_in`, `num_out` its input and output features (the HF weight is `[num_out, num_in]`).
"""

import types
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from jaxpaged.checkpoint.formats import awq, gptq, pack_quantized
from jaxpaged.checkpoint.formats.headers import Header, check_headers
from jaxpaged.checkpoint.group_quant import GroupQuantized
from jaxpaged.config.group_formats import GroupFormat
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.params.tables import param_specs

READERS: dict[str, types.ModuleType] = {"awq": awq, "gptq": gptq, "compressed-tensors": pack_quantized}

Linear = tuple[str, int, int]  # (prefix, num_in, num_out)


def quantized_linears(config: ModelConfig) -> list[Linear]:
    """`(prefix, num_in, num_out)` of every linear a quantized checkpoint of `config` stores as
    integer codes (the decoder layers' projections), layer by layer."""
    specs = [p for p in param_specs(config) if p.quantize]
    linears = []
    for layer in range(config.num_layers):
        for spec in specs:
            num_out, num_in = spec.hf_shape(config)
            linears.append((spec.hf_key(layer).removesuffix(".weight"), num_in, num_out))
    return linears


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
      ValueError: naming the first tensor that is missing, misshaped or wrongly typed.
    """
    module = reader(fmt)
    names = []
    for prefix, num_in, num_out in linears:
        expected = module.stored_tensors(fmt, prefix, num_in, num_out)
        check_headers(fmt, expected, headers)
        names += [t.name for t in expected if t.name in headers]
    return names


def read_linears(
    fmt: GroupFormat, linears: Iterable[Linear], read: Mapping[str, np.ndarray]
) -> Iterator[tuple[str, GroupQuantized]]:
    """`(prefix, GroupQuantized)` of every linear (checked by `check_linears`), each read from
    `read[name]` (a mapping that may read lazily) as it is reached."""
    module = reader(fmt)
    for prefix, num_in, num_out in linears:
        names = [t.name for t in module.stored_tensors(fmt, prefix, num_in, num_out)]
        tensors = {name: read[name] for name in names if name in read}
        yield prefix, module.unpack(fmt, prefix, tensors, num_in)
