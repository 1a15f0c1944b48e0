"""One parameter's declaration (`ParamSpec`) and the logical axes its shape is written in.

A parameter's shape is never written out: it is its logical axes' sizes in the model config
(`axis_sizes`), so one declaration serves the model, the sharding rules, the checkpoint map and
the memory plan. Parameters under `LAYER_STACK` exist once per decoder layer; their axes are
one layer's (the model and the sharding table add a leading `LAYERS` axis where layers are
stacked).

How a Hugging Face checkpoint stores a parameter (`hf_layout`):

    "same"    our shape as it is (the embedding table `[V, D]`)
    "flat"    our shape flattened to one axis (norm scales, biases: q_bias `[N, H]` <- `[N*H]`)
    "linear"  a linear layer's `weight[out, in]` (`y = x @ W.T`) of our `[*in, *out]`, head axes
              split out: q_proj `[D, N, H]` <- `[N*H, D]` transposed; the first `num_in` axes
              are the inputs, which the matmul contracts

A parameter may be one part of a tensor the checkpoint stores fused with others (`Fused`:
Phi-3's `qkv_proj` holds q, k and v one after another along its outputs, its `gate_up_proj` gate
and up): its `hf_shape` is the fused tensor's, and the loader, the 4-bit formats and
`update_weights` cut its rows out of it (`Fused.rows`) before the layout above applies.

A `quantize` parameter (a decoder layer's projection) is replaced under weight quantization by
its pair `<name>_quant` `[*out, *in]` (outputs first, as the fp8 GEMM wants it) and
`<name>_scale` `[*out]` (one float32 scale per output channel; see `jaxpaged.model.quant`).
Group-quantized (a config with `weight_group_size`), it is replaced by `<name>_quant` `[*in, *out]`
(its own axes: 4- or 8-bit codes), `<name>_scale` and `<name>_zero` `[G, *out]` (see
`jaxpaged.model.group_quant`). G is the weight's group axis (`GROUP_AXES`, named after its first
input axis): its inputs flattened, in groups of `weight_group_size`, so it is split over devices
wherever that first input axis is, and a group never straddles two devices. With
`weight_act_order` (GPTQ's `desc_act`: groups not contiguous in the checkpoint) the inputs are
stored sorted by group and `<name>_perm` `[I]` (int32, whole on every device) says which input
each stored row reads: the matmul gathers the activation's features by it.
"""

import dataclasses
import math
from collections.abc import Callable

from jaxpaged.config.model_config import ModelConfig

Path = tuple[str, ...]

# Logical axes: declared once here; `jaxpaged.parallel.sharding` maps them onto the mesh.
LAYERS, VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP = (
    "layers",
    "vocab",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
)

# Mixture-of-experts axes (`jaxpaged.config.moe`): E experts, one expert's FFN width, the shared
# expert's FFN width. A parameter with an `EXPERTS` axis leads with it, and its checkpoint stores
# one tensor per expert (`{expert}` in its name).
EXPERTS, EXPERT_MLP, SHARED_MLP = "experts", "expert_mlp", "shared_mlp"
# The group axis of a weight whose first input axis (after the experts' axis) is the key: its
# inputs flattened, over the group size (o_proj's inputs are (HEADS, HEAD_DIM), the others' one axis).
GROUP_AXES = {a: a + "_groups" for a in (EMBED, HEADS, MLP, EXPERT_MLP, SHARED_MLP)}
# The flattened inputs of such a weight (the axis of its act-order permutation).
FEATURE_AXES = {a: a + "_features" for a in GROUP_AXES}

# The module whose parameters exist once per decoder layer (the first key of their paths).
LAYER_STACK = "layers"
# The names of a quantized weight's pair: `<name>_quant`, `<name>_scale`; a group-quantized one's
# zero points and act-order permutation: `<name>_zero`, `<name>_perm`.
QUANT_SUFFIX, SCALE_SUFFIX, ZERO_SUFFIX, PERM_SUFFIX = "_quant", "_scale", "_zero", "_perm"

HF_LAYOUTS = ("same", "flat", "linear")
INITS = ("normal", "ones", "zeros")  # normal: the model's INIT_STDDEV (random weights, dummy loads)


def axis_sizes(config: ModelConfig) -> dict[str, int]:
    """Each logical axis' size in `config` (the group axes when its weights are group-quantized)."""
    sizes = {
        LAYERS: config.num_layers,
        VOCAB: config.vocab_size,
        EMBED: config.hidden_size,
        HEADS: config.num_heads,
        KV_HEADS: config.num_kv_heads,
        HEAD_DIM: config.head_dim,
        MLP: config.intermediate_size,
        **_moe_axis_sizes(config),
    }
    if config.weight_group_size is not None:
        features = group_features(config)
        sizes.update({GROUP_AXES[a]: n // config.weight_group_size for a, n in features.items()})
        sizes.update({FEATURE_AXES[a]: n for a, n in features.items()})
    return sizes


def group_features(config: ModelConfig) -> dict[str, int]:
    """The flattened inputs of the projections of `config`, by their first input axis (the
    experts' FFN width and the shared expert's where a mixture of experts has no dense MLP)."""
    features = {EMBED: config.hidden_size, HEADS: config.num_heads * config.head_dim}
    if config.moe is None:
        return {**features, MLP: config.intermediate_size}
    shared = {SHARED_MLP: config.moe.shared_expert_size} if config.moe.shared_expert_size else {}
    return {**features, EXPERT_MLP: config.moe.expert_size, **shared}


def _moe_axis_sizes(config: ModelConfig) -> dict[str, int]:
    moe = config.moe
    if moe is None:
        return {}
    return {EXPERTS: moe.num_slots, EXPERT_MLP: moe.expert_size, SHARED_MLP: moe.shared_expert_size}


@dataclasses.dataclass(frozen=True)
class Fused:
    """A parameter the checkpoint stores as one part of a fused tensor: the parts' rows (a
    linear's output features, a flat tensor's elements) follow one another in `parts`' order.

    Attributes:
      parts: each part's output axes, e.g. Phi-3's `qkv_proj`: `((HEADS, HEAD_DIM), (KV_HEADS,
        HEAD_DIM), (KV_HEADS, HEAD_DIM))`.
      index: which part this parameter is.
    """

    parts: tuple[tuple[str, ...], ...]
    index: int

    def __post_init__(self):
        assert 0 <= self.index < len(self.parts), self

    def _lengths(self, config: ModelConfig) -> list[int]:
        sizes = axis_sizes(config)
        return [math.prod(sizes[a] for a in part) for part in self.parts]

    def rows(self, config: ModelConfig) -> tuple[int, int]:
        """`(start, stop)`: this part's rows of the fused tensor."""
        lengths = self._lengths(config)
        start = sum(lengths[: self.index])
        return start, start + lengths[self.index]

    def total(self, config: ModelConfig) -> int:
        """The fused tensor's rows."""
        return sum(self._lengths(config))


def always(_: ModelConfig) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter of an architecture.

    Attributes:
      path: its path in the model state, e.g. `("layers", "attn", "q_proj")`.
      axes: its logical axes (of one layer for a per-layer parameter).
      hf_name: its checkpoint name; `{layer}` stands for the decoder layer's index, `{expert}`
        for the expert's (a per-expert parameter: one tensor per expert, stacked on `EXPERTS`).
      hf_layout: how the checkpoint stores it, one of `HF_LAYOUTS` (see the module docstring).
      num_in: for "linear": how many leading axes are inputs.
      quantize: weight quantization replaces it by its quantized pair.
      init: its random initialisation, one of `INITS`.
      exists: whether a model of the given config has it (e.g. biases only with `qkv_bias`).
      fused: the part of a fused checkpoint tensor it is (`hf_name` names the fused tensor), or
        None: a tensor of its own.
    """

    path: Path
    axes: tuple[str, ...]
    hf_name: str
    hf_layout: str = "flat"
    num_in: int = 0
    quantize: bool = False
    init: str = "normal"
    exists: Callable[[ModelConfig], bool] = always
    fused: Fused | None = None

    def __post_init__(self):
        assert self.hf_layout in HF_LAYOUTS and self.init in INITS, self
        assert (self.hf_layout == "linear") == (self.num_in > 0) and 0 <= self.num_in < len(self.axes) + 1, self
        assert not self.quantize or self.hf_layout == "linear", self
        assert self.per_layer == ("{layer}" in self.hf_name), self
        assert self.per_expert == (self.axes[:1] == (EXPERTS,)), self
        if self.fused is not None:  # its part's axes are its outputs; experts are never fused
            assert self.hf_layout != "same" and not self.per_expert, self
            assert self.fused.parts[self.fused.index] == self.axes[self.num_in :], self

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def per_layer(self) -> bool:
        """The parameter exists once per decoder layer."""
        return self.path[0] == LAYER_STACK

    @property
    def per_expert(self) -> bool:
        """The checkpoint stores one tensor per expert; our parameter stacks them on a leading
        `EXPERTS` axis (a batch axis of every layout, never an input or output)."""
        return "{expert}" in self.hf_name

    @property
    def num_lead(self) -> int:
        """Leading batch axes (the experts' axis) before the inputs."""
        return 1 if self.per_expert else 0

    def shape(self, config: ModelConfig) -> tuple[int, ...]:
        """Our shape (of one layer)."""
        sizes = axis_sizes(config)
        return tuple(sizes[a] for a in self.axes)

    def hf_shape(self, config: ModelConfig) -> tuple[int, ...]:
        """The shape the checkpoint stores (of one expert's tensor for a per-expert parameter)."""
        shape = self.shape(config)[self.num_lead :]
        if self.hf_layout == "same":
            return shape
        rows = math.prod(shape[self.num_in :]) if self.fused is None else self.fused.total(config)
        if self.hf_layout == "flat":
            return (rows,)
        return rows, math.prod(shape[: self.num_in])

    def hf_rows(self, config: ModelConfig) -> tuple[int, int] | None:
        """`(start, stop)`: the rows of the stored tensor that are this parameter (a fused
        tensor's part); None: all of them."""
        return None if self.fused is None else self.fused.rows(config)

    def hf_key(self, layer: int | None, expert: int | None = None) -> str:
        return self.hf_name.format(layer=layer, expert=expert) if self.per_layer else self.hf_name

    @property
    def quantized_axes(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The logical axes of the quantized pair: `<name>_quant` `[*lead, *out, *in]`,
        `<name>_scale` `[*lead, *out]` (lead: the experts' axis of a per-expert weight)."""
        lead, rest = self.axes[: self.num_lead], self.axes[self.num_lead :]
        inputs, outputs = rest[: self.num_in], rest[self.num_in :]
        return lead + outputs + inputs, lead + outputs

    @property
    def quantized_paths(self) -> tuple[Path, Path]:
        return self.path[:-1] + (self.name + QUANT_SUFFIX,), self.path[:-1] + (self.name + SCALE_SUFFIX,)

    def grouped_axes(self, act_order: bool = False) -> tuple[tuple[str, ...], ...]:
        """The logical axes of the group-quantized arrays: `<name>_quant` `[*lead, *in, *out]`,
        `<name>_scale` and `<name>_zero` `[*lead, G, *out]`, with `act_order` `<name>_perm`
        `[*lead, I]` (lead: the experts' axis of a per-expert weight, each expert quantized alone)."""
        lead, first_in = self.axes[: self.num_lead], self.axes[self.num_lead]
        groups = lead + (GROUP_AXES[first_in],) + self.axes[self.num_lead + self.num_in :]
        return (self.axes, groups, groups) + ((lead + (FEATURE_AXES[first_in],),) if act_order else ())

    def grouped_paths(self, act_order: bool = False) -> tuple[Path, ...]:
        suffixes = (ZERO_SUFFIX, PERM_SUFFIX) if act_order else (ZERO_SUFFIX,)
        return self.quantized_paths + tuple(self.path[:-1] + (self.name + suffix,) for suffix in suffixes)
