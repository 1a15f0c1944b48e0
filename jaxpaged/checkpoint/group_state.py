"""Group-quantized checkpoints into the model state: the hook every 4/8-bit format reader plugs into.

A format reader (AWQ, GPTQ, compressed-tensors pack-quantized) is a `LinearReader`: a function
that takes the Hugging Face prefix of one decoder projection, e.g.
`"model.layers.0.self_attn.q_proj"`, reads that linear's tensors (`qweight`, `qzeros`,
`scales`, `g_idx`, ... as its format names them), checks them and returns their meaning as a
`GroupQuantized` (`jaxpaged.checkpoint.group_quant`: unpacked uint8 codes `[I, O]` in the HF
linear's features, scales and zero points `[G, O]`). `group_tensors(config, read_linear)` calls it
for every projection of every layer (the parameter table's `quantize` weights) and yields the
model state's arrays (`jaxpaged.model.group_quant`) as the loader's `(path, layer, array)`; the
checkpoint's other tensors (embedding, norms, LM head) are read as in a plain checkpoint.

`group_state` is the one conversion: codes made signed (`c - 2**(bits-1)`, in `code_dtype`) and
reshaped to our `[*in, *out]`, scales to `[G, *out]` float32, zero points to `[G, *out]` int8.
Round-to-nearest int4 at load (`--quantization int4`) produces the same arrays on the device
(`jaxpaged.model.group_quant.quantize_groups`).
"""

import functools
from collections.abc import Callable, Iterator

import numpy as np

from jaxpaged.checkpoint.group_quant import GroupQuantized
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.spec import ParamSpec, Path
from jaxpaged.config.params.tables import linear_prefixes, param_specs, quantized_paths
from jaxpaged.model.group_quant import code_dtype

# The reader hook: an HF projection's prefix (its tensors' names without `.qweight` etc.) -> its weight.
LinearReader = Callable[[str], GroupQuantized]


def group_state(gq: GroupQuantized, spec: ParamSpec, config: ModelConfig, prefix: str) -> tuple[np.ndarray, ...]:
    """One projection's `GroupQuantized` as its state arrays `(codes [*in, *out], scale [G, *out],
    zero [G, *out])`, and with `config.weight_act_order` `perm [I]` (one layer's, one expert's of
    a per-expert weight): the inputs
    sorted by their group (`g_idx`; stable, so contiguous groups keep their order and an identity
    permutation), `perm[i]` the input stored row i reads.

    Raises:
      ValueError: naming `prefix`, when its bits, group size or shapes are not the model's, its
        groups are not contiguous and the model is not act-ordered (config.json's `desc_act`), or
        a group does not hold exactly `group_size` inputs.
    """
    shape = spec.shape(config)[spec.num_lead :]
    ins, outs = shape[: spec.num_in], shape[spec.num_in :]
    expected = (int(np.prod(ins)), int(np.prod(outs)))
    if gq.bits != config.weight_bits or gq.group_size != config.weight_group_size:
        raise ValueError(
            f"{prefix}: {gq.bits}-bit codes in groups of {gq.group_size}, but the model is "
            f"{config.weight_bits}-bit in groups of {config.weight_group_size} (config.json's quantization_config)"
        )
    if gq.q.shape != expected:
        raise ValueError(f"{prefix}: codes of shape {list(gq.q.shape)}, expected [in, out] = {list(expected)}")
    contiguous = np.arange(expected[0]) // gq.group_size
    perm = np.argsort(gq.groups(), kind="stable").astype(np.int32)
    if not config.weight_act_order and not np.array_equal(perm, np.arange(expected[0])):
        raise ValueError(
            f"{prefix}: g_idx orders the inputs by activation (desc_act), but the model's quantization_config "
            "does not say desc_act"
        )
    if not np.array_equal(gq.groups()[perm], contiguous):
        raise ValueError(f"{prefix}: g_idx does not put exactly {gq.group_size} inputs in each group")
    offset = 2 ** (gq.bits - 1)
    codes = (gq.q[perm].astype(np.int16) - offset).astype(code_dtype(gq.bits)).reshape(shape)
    groups = (gq.scale.shape[0], *outs)
    zero = (gq.zero.astype(np.int16) - offset).astype(np.int8).reshape(groups)
    arrays = (codes, gq.scale.astype(np.float32).reshape(groups), zero)
    return arrays + (perm,) if config.weight_act_order else arrays


def group_tensors(
    config: ModelConfig, read_linear: LinearReader, layers: frozenset[int] | None = None
) -> Iterator[tuple[Path, int, np.ndarray]]:
    """Every group-quantized projection of every decoder layer (of `layers`; None: all) as the
    loader's `(path, layer, array)`: `read_linear(prefix)` converted by `group_state`, layer by
    layer (a per-expert weight's experts each read and converted alone, then stacked `[E, ...]`;
    a fused linear read once, each part its own outputs: `ParamSpec.hf_rows`)."""
    specs = [spec for spec in param_specs(config) if spec.quantize]
    read = functools.lru_cache(maxsize=1)(read_linear)  # a fused linear's parts follow one another

    def part(spec: ParamSpec, prefix: str) -> GroupQuantized:
        rows = spec.hf_rows(config)
        return read(prefix) if rows is None else read(prefix).outputs(*rows)

    for layer in range(config.num_layers) if layers is None else sorted(layers):
        for spec in specs:
            experts = [group_state(part(spec, p), spec, config, p) for p in linear_prefixes(spec, config, layer)]
            arrays = [np.stack(a) for a in zip(*experts)] if spec.per_expert else experts[0]
            yield from ((path, layer, array) for path, array in zip(quantized_paths(config, spec), arrays))
