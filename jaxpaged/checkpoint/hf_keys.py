"""The explicit map from Hugging Face tensor names to jaxpaged parameters.

Every expected HF tensor is spelled out per layer from the `ModelConfig` (no regex guessing),
with its target path in `nnx.state(Llama).to_pure_dict()` (and, for a decoder layer's tensor,
its index in that stacked parameter), its HF shape and the transform to our einsum-ready layout. Dimension letters: D hidden, N query heads, K kv heads, H head_dim,
F MLP width, V vocabulary.

HF stores a linear layer as `weight[out, in]` (`y = x @ W.T`); we store `[in, ...out]` with the
head axes split out: q `[N*H, D] -> [D, N, H]`, o `[D, N*H] -> [N, H, D]`, mlp `[F, D] -> [D, F]`.
"""

import dataclasses

import numpy as np

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.parallel.sharding import LAYER_STACK, QUANT_SUFFIX, QUANTIZED_INPUT_AXES, SCALE_SUFFIX

Path = tuple[str, ...]


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
    """

    hf_name: str
    target: Path
    hf_shape: tuple[int, ...]
    shape: tuple[int, ...]
    transpose: bool
    layer: int | None = None

    def transform(self, x: np.ndarray) -> np.ndarray:
        """Checks the HF shape, then returns a C-contiguous array in our layout.

        Raises:
          ValueError: naming the key, the expected and the actual shape.
        """
        check_shape(self.hf_name, self.hf_shape, x.shape)
        y = x.T if self.transpose else x
        return np.ascontiguousarray(y.reshape(self.shape))

    @property
    def description(self) -> str:
        """The transform in words, e.g. `[256, 64] -T-> [64, 4, 64]`."""
        arrow = "-T->" if self.transpose else "->"
        return f"{list(self.hf_shape)} {arrow} {list(self.shape)}"


def check_shape(name: str, expected: tuple[int, ...], actual: tuple[int, ...]) -> None:
    """Raises ValueError naming the tensor `name` when `actual != expected`."""
    if tuple(actual) != tuple(expected):
        raise ValueError(
            f"tensor {name!r} has shape {list(actual)}, expected {list(expected)} from config.json; "
            "the checkpoint does not match its config"
        )


def hf_key_specs(config: ModelConfig) -> list[KeySpec]:
    """Every tensor a checkpoint of this config must hold, in a stable order.

    Args:
      config: the model configuration (from the checkpoint's config.json).

    Returns:
      One `KeySpec` per parameter of `Llama(config)`; their targets are exactly the leaves
      of its state pure dict.
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
        specs += [KeySpec(*fields, layer=i) for fields in layer]
    specs.append(KeySpec("model.norm.weight", ("final_norm", "scale"), (d,), (d,), False))
    if not config.tie_word_embeddings:
        specs.append(KeySpec("lm_head.weight", ("lm_head",), (v, d), (d, v), True))
    return specs


def optional_hf_keys(config: ModelConfig) -> dict[str, tuple[int, ...] | None]:
    """Tensors a checkpoint may hold that are not parameters; they are checked and dropped.

    Returns:
      name -> required shape (None: any shape). A tied checkpoint may still store
      `lm_head.weight` (a copy of the embedding, `[V, D]`); older transformers saved the
      rotary `inv_freq` buffer of each layer.
    """
    optional: dict[str, tuple[int, ...] | None] = {
        f"model.layers.{i}.self_attn.rotary_emb.inv_freq": None for i in range(config.num_layers)
    }
    if config.tie_word_embeddings:
        optional["lm_head.weight"] = (config.vocab_size, config.hidden_size)
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


def format_names(names, limit: int = 20) -> str:
    """Sorted, comma-separated names, truncated after `limit` with a count of the rest."""
    names = sorted(names)
    shown = ", ".join(names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names) - limit} more)"
    return shown
