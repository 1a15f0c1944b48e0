"""The explicit map from Hugging Face tensor names to jaxpaged parameters.

Every expected HF tensor is spelled out per layer from the `ModelConfig` (no regex guessing),
with its target path in `nnx.state(Llama).to_pure_dict()` (and, for a decoder layer's tensor,
its index in that stacked parameter), its HF shape and the transform to our einsum-ready layout.
Dimension letters: D hidden, N query heads, K kv heads, H head_dim, F MLP width, V vocabulary.

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
import math

import ml_dtypes
import numpy as np

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.quantization import QUANTIZED_WEIGHT_DTYPES
from jaxpaged.parallel.sharding import LAYER_STACK, QUANT_SUFFIX, QUANTIZED_INPUT_AXES, SCALE_SUFFIX

Path = tuple[str, ...]
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
      dtype: the dtype the tensor keeps whatever the model's dtype, a key of `KEPT_DTYPES`
        ("float8_e4m3fn": a pre-quantized weight, "float32": its scale); None: a plain tensor,
        cast to the model's dtype.
      broadcast: a scale that may also be one number for the whole tensor (`SCALAR_SHAPES`),
        broadcast to `shape`.
    """

    hf_name: str
    target: Path
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    transpose: bool
    layer: int | None = None
    dtype: str | None = None
    broadcast: bool = False

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
        y = x.T if self.transpose else x
        return np.ascontiguousarray(y.reshape(self.shape))

    @property
    def description(self) -> str:
        """The transform in words, e.g. `[256, 64] -T-> [64, 4, 64]`."""
        arrow = "-T->" if self.transpose else "->"
        text = f"{list(self.hf_shape)} {arrow} {list(self.shape)}"
        if self.broadcast:
            text += f" (or [1] / [] broadcast to {list(self.shape)})"
        return text + (f" {self.dtype}" if self.dtype else "")


def check_shape(name: str, expected: tuple[int, ...], actual: tuple[int, ...],
                also: tuple[tuple[int, ...], ...] = ()) -> None:  # fmt: skip
    """Raises ValueError naming the tensor `name` when `actual` is neither `expected` nor one of
    `also`."""
    if tuple(actual) != tuple(expected) and tuple(actual) not in also:
        alternatives = "".join(f" or {list(shape)}" for shape in also)
        raise ValueError(
            f"tensor {name!r} has shape {list(actual)}, expected {list(expected)}{alternatives} from config.json; "
            "the checkpoint does not match its config"
        )


def hf_key_specs(config: ModelConfig, prequantized: str | None = None) -> list[KeySpec]:
    """Every tensor a checkpoint of this config must hold, in a stable order.

    Args:
      config: the model configuration (from the checkpoint's config.json).
      prequantized: the method the checkpoint's weights are already quantized with
        (`checkpoint_quantization` of its config.json: "fp8" for compressed-tensors FP8), or
        None for plain weights.

    Returns:
      One `KeySpec` per parameter of `Llama(config, quantization=prequantized)`; their targets
      are exactly the leaves of its state pure dict.
    """
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    n, k, h = config.num_heads, config.num_kv_heads, config.head_dim
    specs = [KeySpec("model.embed_tokens.weight", ("embed",), (v, d), (v, d), False)]
    at = ("layers", "attn")
    for i in range(config.num_layers):
        hf = f"model.layers.{i}."
        layer = [
            (hf + "input_layernorm.weight", ("layers", "input_norm", "scale"), (d,), (d,), False),
            (hf + "self_attn.q_proj.weight", at + ("q_proj",), (n * h, d), (d, n, h), True),
            (hf + "self_attn.k_proj.weight", at + ("k_proj",), (k * h, d), (d, k, h), True),
            (hf + "self_attn.v_proj.weight", at + ("v_proj",), (k * h, d), (d, k, h), True),
            (hf + "self_attn.o_proj.weight", at + ("o_proj",), (d, n * h), (n, h, d), True),
        ]
        if config.qkv_bias:
            layer += [
                (hf + "self_attn.q_proj.bias", at + ("q_bias",), (n * h,), (n, h), False),
                (hf + "self_attn.k_proj.bias", at + ("k_bias",), (k * h,), (k, h), False),
                (hf + "self_attn.v_proj.bias", at + ("v_bias",), (k * h,), (k, h), False),
            ]
        if config.o_bias:
            layer.append((hf + "self_attn.o_proj.bias", at + ("o_bias",), (d,), (d,), False))
        layer += [
            (hf + "post_attention_layernorm.weight", ("layers", "post_attention_norm", "scale"), (d,), (d,), False),
            (hf + "mlp.gate_proj.weight", ("layers", "mlp", "gate_proj"), (f, d), (d, f), True),
            (hf + "mlp.up_proj.weight", ("layers", "mlp", "up_proj"), (f, d), (d, f), True),
            (hf + "mlp.down_proj.weight", ("layers", "mlp", "down_proj"), (d, f), (f, d), True),
        ]
        for fields in layer:
            spec = KeySpec(*fields, layer=i)
            quantized = prequantized is not None and quantized_paths(spec.target) is not None
            specs += _prequantized(spec, prequantized) if quantized else [spec]
    specs.append(KeySpec("model.norm.weight", ("final_norm", "scale"), (d,), (d,), False))
    if not config.tie_word_embeddings:
        specs.append(KeySpec("lm_head.weight", ("lm_head",), (v, d), (d, v), True))
    return specs


def _prequantized(spec: KeySpec, method: str) -> list[KeySpec]:
    """The pair a pre-quantized checkpoint stores for a plain weight's spec: the quantized
    `weight` `[out, in]` reshaped to `<name>_quant` `[*out, *in]`, and `weight_scale` (`[out, 1]`,
    or one number) to `<name>_scale` `[*out]`."""
    quant, scale = quantized_paths(spec.target)
    num_in = QUANTIZED_INPUT_AXES[spec.target[-1]]
    inputs, outputs = spec.shape[:num_in], spec.shape[num_in:]
    assert spec.transpose and spec.hf_shape == (math.prod(outputs), math.prod(inputs)), spec
    return [
        KeySpec(spec.hf_name, quant, spec.hf_shape, (*outputs, *inputs), False, spec.layer,
                dtype=QUANTIZED_WEIGHT_DTYPES[method]),  # fmt: skip
        KeySpec(spec.hf_name + "_scale", scale, (spec.hf_shape[0], 1), outputs, False, spec.layer, dtype="float32",
                broadcast=True),  # fmt: skip
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
    (stacked parameters `[L, ...]`; a quantized weight as its pair, see `quantized_paths`)."""
    shapes = {spec.target: spec.shape if spec.layer is None else (config.num_layers, *spec.shape)
              for spec in hf_key_specs(config)}  # fmt: skip
    if quantization is None:
        return shapes
    out = {}
    for path, shape in shapes.items():
        pair = quantized_paths(path)
        if pair is None:
            out[path] = shape
            continue
        lead = 1 if path[0] == LAYER_STACK else 0
        num_in = QUANTIZED_INPUT_AXES[path[-1]]
        inputs, outputs = shape[lead : lead + num_in], shape[lead + num_in :]
        out[pair[0]] = (*shape[:lead], *outputs, *inputs)
        out[pair[1]] = (*shape[:lead], *outputs)
    return out


def quantized_paths(path: Path) -> tuple[Path, Path] | None:
    """`(weight, scale)` paths that replace the weight at `path` under quantization (None: it
    is not quantized)."""
    if path[-1] not in QUANTIZED_INPUT_AXES:
        return None
    return path[:-1] + (path[-1] + QUANT_SUFFIX,), path[:-1] + (path[-1] + SCALE_SUFFIX,)


def kept_dtype(path: Path, prequantized: str | None) -> np.dtype | None:
    """The dtype the parameter at `path` keeps whatever the model's dtype when the checkpoint is
    pre-quantized with `prequantized`: a quantized weight its storage type, its scale float32;
    None: a plain parameter, or a plain checkpoint."""
    if prequantized is None:
        return None
    name = path[-1]
    for suffix, dtype in ((QUANT_SUFFIX, QUANTIZED_WEIGHT_DTYPES[prequantized]), (SCALE_SUFFIX, "float32")):
        if isinstance(name, str) and name.endswith(suffix) and name.removesuffix(suffix) in QUANTIZED_INPUT_AXES:
            return KEPT_DTYPES[dtype]
    return None


def format_names(names, limit: int = 20) -> str:
    """Sorted, comma-separated names, truncated after `limit` with a count of the rest."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return shown
