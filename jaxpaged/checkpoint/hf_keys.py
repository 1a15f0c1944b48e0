"""The explicit map from Hugging Face tensor names to jaxpaged parameters.

Every expected HF tensor is spelled out per layer from the architecture's parameter table
(`jaxpaged.config.architectures`: names, layouts and shapes are declared there; no regex guessing), with its
target path in `nnx.state(Llama).to_pure_dict()` (and, for a decoder layer's tensor, its index in
that stacked parameter), its HF shape and the transform to our einsum-ready layout.
Dimension letters: D hidden, N query heads, K kv heads, H head_dim, F MLP width, V vocabulary.

A mixture of experts' checkpoint stores each expert's projection as a tensor of its own
(`...experts.{expert}.w1.weight`); each is one expert's row of our `[E, ...]` parameter.

HF stores a linear layer as `weight[out, in]` (`y = x @ W.T`); we store `[in, ...out]` with the
head axes split out: q `[N*H, D] -> [D, N, H]`, o `[D, N*H] -> [N, H, D]`, mlp `[F, D] -> [D, F]`.

A pre-quantized checkpoint (compressed-tensors FP8, see `jaxpaged.config.quantization`) stores each
decoder layer's q/k/v/o/gate/up/down projection as `weight` in float8_e4m3fn `[out, in]` beside
`weight_scale` (float32 or bfloat16), `[out, 1]` per output channel or one number (`[1]` or `[]`)
for the whole tensor. They map onto our quantized pair (`jaxpaged.model.quant`): `<name>_quant`
is stored outputs first, which is HF's order, so the weight is only reshaped and keeps its fp8
bytes (q `[N*H, D] -> [N, H, D]`, o `[D, N*H] -> [D, N, H]`, mlp `[F, D] -> [F, D]`);
`<name>_scale` becomes float32 `[*out]` (q `[N*H, 1] -> [N, H]`; a per-tensor scale broadcast to
every output channel). Static activation scales (`input_scale`) and KV cache scales
(`self_attn.k_scale`/`v_scale`, or older `k_proj.output_scale`/`v_proj.output_scale`) are
optional: checked to be one number and dropped (activations are quantized per token at run
time; an fp8 KV cache keeps the scales of `jaxpaged.model.kv_pool.KVQuant`, not the checkpoint's).
Embedding, norms and LM head stay plain.
"""

import dataclasses

import ml_dtypes
import numpy as np

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.spec import ParamSpec, Path
from jaxpaged.config.params.tables import find_state_param, param_specs, state_shapes
from jaxpaged.config.quantization import QUANTIZED_WEIGHT_DTYPES, group_dtypes

Shapes = tuple[tuple[int, ...], ...]  # the shapes a tensor may have

# The dtype a pre-quantized tensor keeps whatever the model's dtype, and the safetensors dtypes it
# may be stored in (a scale is read from any float type and kept in float32).
KEPT_DTYPES = {"float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn), "float32": np.dtype(np.float32)}
STORED_DTYPES = {"float8_e4m3fn": ("F8_E4M3",), "float32": ("F32", "BF16", "F16")}
# What a plain tensor may be stored as (cast to the model's dtype when read).
PLAIN_STORED_DTYPES = ("F32", "BF16", "F16", "F64")
# The shapes of one number for a whole tensor (compressed-tensors writes `[1]`; older files `[]`).
SCALAR_SHAPES: Shapes = ((), (1,))


@dataclasses.dataclass(frozen=True)
class KeySpec:
    """One expected HF tensor and how it becomes one of our parameters.

    Attributes:
      hf_name: the tensor name in the safetensors files.
      target: the path in our nested params dict, e.g. `("layers", "attn", "q_proj")`.
      hf_shape: the shape HF stores.
      shape: our shape after the transform (of one layer for a stacked parameter).
      transpose: whether the transform transposes (a 2-D HF weight) before reshaping to `shape`.
      layer: the tensor's index in the stacked parameter `target` (None: not a layer's).
      expert: the expert's index in the layer's `[E, ...]` array of a per-expert parameter
        (None: not an expert's); `shape` is then one expert's.
      dtype: the dtype the tensor keeps whatever the model's dtype, a key of `KEPT_DTYPES`
        ("float8_e4m3fn": a pre-quantized weight, "float32": its scale); None: a plain tensor,
        cast to the model's dtype.
      broadcast: a scale that may also be one number for the whole tensor (`SCALAR_SHAPES`),
        broadcast to `shape`.
      rows: `(start, stop)`: the rows (first axis) of the stored tensor that are this parameter,
        cut out before the transform (one part of a fused tensor, `ParamSpec.fused`: several
        key specs share its name); None: the whole tensor.
    """

    hf_name: str
    target: Path
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    transpose: bool
    layer: int | None = None
    dtype: str | None = None
    broadcast: bool = False
    expert: int | None = None
    rows: tuple[int, int] | None = None

    def check(self, shape: tuple[int, ...], stored_dtype: str | None = None) -> None:
        """Checks a stored shape (and the safetensors dtype, when given) from the header.

        Raises:
          ValueError: naming the key, the expected and the actual shape or dtype.
        """
        check_shape(self.hf_name, self.hf_shape, shape, also=SCALAR_SHAPES if self.broadcast else ())
        allowed = PLAIN_STORED_DTYPES if self.dtype is None else STORED_DTYPES[self.dtype]
        if stored_dtype is not None and stored_dtype not in allowed:
            what = {None: "a plain tensor", "float32": "a weight scale"}.get(self.dtype, "a pre-quantized weight")
            raise ValueError(
                f"tensor {self.hf_name!r} is stored as {stored_dtype}, expected {' or '.join(allowed)} for {what}; "
                "the checkpoint does not match its config.json (quantization_config)"
            )

    def transform(self, x: np.ndarray, dtype: np.dtype | None = None) -> np.ndarray:
        """Checks the HF shape, then returns a C-contiguous array in our layout.

        Args:
          x: the tensor as stored.
          dtype: the model's dtype, for a plain tensor (None: keep x's); a pre-quantized tensor
            always gets `KEPT_DTYPES[self.dtype]` (fp8 bytes unchanged, scales in float32).

        Raises:
          ValueError: naming the key, the expected and the actual shape.
        """
        self.check(x.shape)
        dtype = KEPT_DTYPES[self.dtype] if self.dtype is not None else dtype
        if dtype is not None:
            x = x.astype(dtype, copy=False)
        if self.broadcast and x.shape in SCALAR_SHAPES:
            return np.full(self.shape, x.reshape(()), x.dtype)
        if self.rows is not None:
            x = x[self.rows[0] : self.rows[1]]
        y = x.T if self.transpose else x
        return np.ascontiguousarray(y.reshape(self.shape))

    @property
    def description(self) -> str:
        """The transform in words, e.g. `[256, 64] -T-> [64, 4, 64]`."""
        arrow = "-T->" if self.transpose else "->"
        rows = "" if self.rows is None else f"[{self.rows[0]}:{self.rows[1]}] "
        text = f"{list(self.hf_shape)} {rows}{arrow} {list(self.shape)}"
        if self.broadcast:
            text += f" (or [1] / [] broadcast to {list(self.shape)})"
        return text + (f" {self.dtype}" if self.dtype else "")


def check_shape(
    name: str, expected: tuple[int, ...], actual: tuple[int, ...], also: tuple[tuple[int, ...], ...] = ()
) -> None:
    """Raises ValueError naming the tensor `name` when `actual` is neither `expected` nor one of
    `also`."""
    if tuple(actual) != tuple(expected) and tuple(actual) not in also:
        alternatives = "".join(f" or {list(shape)}" for shape in also)
        raise ValueError(
            f"tensor {name!r} has shape {list(actual)}, expected {list(expected)}{alternatives} from config.json; "
            "the checkpoint does not match its config"
        )


def hf_key_specs(config: ModelConfig, prequantized: str | None = None) -> list[KeySpec]:
    """Every tensor a checkpoint of this config must hold, in a stable order (the parameters
    before the decoder layers, the layers one after another, then the rest), from the
    architecture's parameter table.

    Args:
      config: the model configuration (from the checkpoint's config.json).
      prequantized: the method the checkpoint's weights are already quantized with
        (`checkpoint_quantization` of its config.json: "fp8" for compressed-tensors FP8), or
        None for plain weights.

    Returns:
      One `KeySpec` per parameter of `Llama(config, quantization=prequantized)` (per layer for a
      decoder layer's); their targets are exactly the leaves of its state pure dict. The parts of
      a fused tensor share its name (`by_name` groups them).
    """
    params = param_specs(config)
    first_layer = next(i for i, p in enumerate(params) if p.per_layer)
    before = [p for p in params[:first_layer] if not p.per_layer]
    after = [p for p in params[first_layer:] if not p.per_layer]
    per_layer = [p for p in params if p.per_layer]
    order = [(p, None) for p in before]
    order += [(p, i) for i in range(config.num_layers) for p in per_layer]
    order += [(p, None) for p in after]
    specs = []
    for param, layer in order:
        experts = range(config.moe.num_experts) if param.per_expert else (None,)
        for expert in experts:
            spec = KeySpec(
                param.hf_key(layer, expert),
                param.path,
                param.hf_shape(config),
                param.shape(config)[param.num_lead :],
                param.hf_layout == "linear",
                layer,
                expert=expert,
                rows=param.hf_rows(config),
            )
            quantized = prequantized is not None and param.quantize
            specs += _prequantized(spec, param, prequantized) if quantized else [spec]
    return specs


def by_name(specs: list[KeySpec]) -> dict[str, list[KeySpec]]:
    """The key specs of each stored tensor (several for a fused tensor's parts), in order."""
    grouped: dict[str, list[KeySpec]] = {}
    for spec in specs:
        grouped.setdefault(spec.hf_name, []).append(spec)
    return grouped


def _prequantized(spec: KeySpec, param: ParamSpec, method: str) -> list[KeySpec]:
    """The pair a pre-quantized checkpoint stores for a plain weight's spec: the quantized
    `weight` `[out, in]` reshaped to `<name>_quant` `[*out, *in]`, and `weight_scale` (`[out, 1]`,
    or one number) to `<name>_scale` `[*out]`."""
    quant, scale = param.quantized_paths
    inputs, outputs = spec.shape[: param.num_in], spec.shape[param.num_in :]
    return [
        KeySpec(
            spec.hf_name,
            quant,
            spec.hf_shape,
            (*outputs, *inputs),
            False,
            spec.layer,
            dtype=QUANTIZED_WEIGHT_DTYPES[method],
            expert=spec.expert,
            rows=spec.rows,
        ),
        KeySpec(
            spec.hf_name + "_scale",
            scale,
            (spec.hf_shape[0], 1),
            outputs,
            False,
            spec.layer,
            dtype="float32",
            broadcast=True,
            expert=spec.expert,
            rows=spec.rows,
        ),
    ]


def optional_hf_keys(config: ModelConfig, prequantized: str | None = None) -> dict[str, Shapes | None]:
    """Tensors a checkpoint may hold that are not parameters; they are checked and dropped.

    Args:
      config: the model configuration.
      prequantized: as in `hf_key_specs`.

    Returns:
      name -> the shapes it may have (None: any shape). A tied checkpoint may still store
      `lm_head.weight` (a copy of the embedding, `[V, D]`); older transformers saved the
      rotary `inv_freq` buffer of each layer. A pre-quantized checkpoint may store a static
      activation scale (`input_scale`) per quantized projection and KV cache scales per layer,
      each one number (`[1]` or `[]`).
    """
    optional: dict[str, Shapes | None] = {
        f"model.layers.{i}.self_attn.rotary_emb.inv_freq": None for i in range(config.num_layers)
    }
    if config.tie_word_embeddings:
        optional["lm_head.weight"] = ((config.vocab_size, config.hidden_size),)
    if prequantized is not None:
        for spec in hf_key_specs(config, prequantized):
            if spec.dtype == "float32":  # a weight scale: its projection may have a static input scale
                optional[spec.hf_name.removesuffix(".weight_scale") + ".input_scale"] = SCALAR_SHAPES
        for i in range(config.num_layers):
            attn = f"model.layers.{i}.self_attn."
            for name in ("k_scale", "v_scale", "k_proj.output_scale", "v_proj.output_scale"):
                optional[attn + name] = SCALAR_SHAPES
    return optional


def param_shapes(config: ModelConfig, quantization: str | None = None) -> dict[Path, tuple[int, ...]]:
    """Our parameter path -> our shape, for every parameter of `Llama(config, quantization=...)`
    (stacked parameters `[L, ...]`; a quantized weight as its pair)."""
    return state_shapes(config, quantization)


def quantizable(config: ModelConfig, path: Path) -> ParamSpec | None:
    """The declaration of the weight at `path` when weight quantization replaces it by a pair
    (None: a parameter that stays as it is)."""
    param = find_state_param(config, path)
    return param.spec if param.role == "plain" and param.spec.quantize else None


def kept_dtype(config: ModelConfig, path: Path, prequantized: str | None) -> np.dtype | None:
    """The dtype the parameter at `path` keeps whatever the model's dtype when the checkpoint is
    pre-quantized with `prequantized`: a quantized weight its storage type, its scale float32; a
    group-quantized weight's arrays (`config.weight_group_size`) their `group_dtypes` (4-bit codes
    in int4); None: a plain parameter, or a plain checkpoint."""
    if prequantized is None:
        return None
    role = find_state_param(config, path).role
    if config.weight_group_size is not None:
        name = group_dtypes(config.weight_bits).get(role)
        return None if name is None else np.dtype(getattr(ml_dtypes, name, name))
    return {"quant": KEPT_DTYPES[QUANTIZED_WEIGHT_DTYPES[prequantized]], "scale": KEPT_DTYPES["float32"]}.get(role)


def format_names(names, limit: int = 20) -> str:
    """Sorted, comma-separated names, truncated after `limit` with a count of the rest."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return shown
