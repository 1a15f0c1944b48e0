"""Dummy weights (`load_format="dummy"`): random values of the checkpoint's shapes, made on the mesh.

Two small jitted programs make them: one a decoder layer's parameters, called once per layer, and
one the rest (embedding, LM head, final norm), each straight into its shardings. No program holds
more than the values it makes in its temporaries, however many layers the model has (a program
making the whole model needed ~67 GiB of temporaries on a CPU for Llama-3.1-8B). The values are
`Llama`'s own (`jaxpaged.model.llama.initial_value`) at the checkpoint's shapes, put into the mesh
layout afterwards (kv heads repeated), so every tensor-parallel size holds the same model.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.spec import ParamSpec, Path
from jaxpaged.config.params.tables import param_specs, quantized_paths
from jaxpaged.config.sections import LoadConfig
from jaxpaged.model import LayerArrays
from jaxpaged.model.llama import initial_value
from jaxpaged.model.quant import quantize_param
from jaxpaged.parallel.mesh import TensorParallel


def dummy_programs(config: ModelConfig, dtype, load: LoadConfig, parallel: TensorParallel) -> dict[str, object]:
    """The two jitted programs that make the dummy weights, each `(key, layer) -> {path: array}`:
    "layer" makes layer `layer`'s per-layer parameters (an int32; with `load.scan_layers`, every
    layer's, stacked; under pipeline parallelism a layer slot's `[P]` layers, -1 for none, as the
    slot's arrays `[P, ...]`), "model" the others (`layer` unused). Each array is in the mesh layout and
    placed with its sharding; a quantizable weight comes as its pair (group-quantized: triple) under `load.quantization`.
    Only the key and the layer vary between calls: each program compiles once.

    Args:
      config: the checkpoint's model configuration (not the mesh layout's).
      dtype: the parameters' dtype (a quantized pair keeps its own).
      load: the weight `quantization` and `scan_layers`.
      parallel: the mesh and its sharding table.
    """
    specs = param_specs(config)
    stacked = load.scan_layers
    pipeline = parallel.layout.pipeline

    def make(spec: ParamSpec, key, layer) -> dict[Path, jax.Array]:  # one layer's, or a whole parameter
        paths = _state_paths(spec, config, load)
        value = initial_value(spec, config, dtype, key, layer)
        values = (
            quantize_param(value, load.quantization, config, spec.num_in, spec.num_lead) if len(paths) > 1 else (value,)
        )
        return {p: parallel.to_mesh_layout(p, v, one_layer=spec.per_layer) for p, v in zip(paths, values)}

    def one_layer(key, layer):
        return {p: v for s in specs if s.per_layer for p, v in make(s, key, layer).items()}

    def layer_params(key, layer):
        if stacked:
            return jax.vmap(one_layer, (None, 0))(key, jnp.arange(config.num_layers, dtype=jnp.int32))
        if pipeline.size > 1:  # `layer` [P]: a layer slot's layer on each stage (-1: none)
            values = jax.vmap(one_layer, (None, 0))(key, jnp.maximum(layer, 0))
            present = lambda v: (layer >= 0).reshape(-1, *(1,) * (v.ndim - 1))  # noqa: E731
            return {p: jnp.where(present(v), v, jnp.zeros_like(v)) for p, v in values.items()}
        return one_layer(key, layer)

    def model_params(key, layer):
        return {p: v for s in specs if not s.per_layer for p, v in make(s, key, None).items()}

    def shardings(per_layer: bool) -> dict:
        sharding = parallel.layer_sharding if per_layer and not stacked else parallel.param_sharding
        return {p: sharding(p) for s in specs if s.per_layer == per_layer for p in _state_paths(s, config, load)}

    return {
        "layer": jax.jit(layer_params, out_shardings=shardings(True)),
        "model": jax.jit(model_params, out_shardings=shardings(False)),
    }


def dummy_params(config: ModelConfig, dtype, load: LoadConfig, parallel: TensorParallel) -> dict[Path, object]:
    """Every array of the model state with dummy weights from `load.seed`, by path: placed arrays,
    and `LayerArrays` for per-layer parameters with unrolled layers (see the module docstring).

    Args: as `dummy_programs`, and `load.seed`.
    """
    key = nnx.Rngs(load.seed).params()  # the key `Llama(..., rngs=nnx.Rngs(seed))` draws
    programs = dummy_programs(config, dtype, load, parallel)
    params = programs["model"](key, jnp.int32(0))
    if load.scan_layers:
        return {**params, **programs["layer"](key, jnp.int32(0))}
    pipeline = parallel.layout.pipeline
    if pipeline.size > 1:  # one call per layer slot, each stage making its own layer
        slots = [[pipeline.layer_at(s, j) for s in range(pipeline.size)] for j in range(pipeline.max_layers)]
        layers = [
            programs["layer"](key, jnp.array([-1 if x is None else x for x in slot], jnp.int32)) for slot in slots
        ]
    else:
        layers = [programs["layer"](key, jnp.int32(layer)) for layer in range(config.num_layers)]
    return {**params, **{path: LayerArrays(layer[path] for layer in layers) for path in layers[0]}}


def _state_paths(spec: ParamSpec, config: ModelConfig, load: LoadConfig) -> tuple[Path, ...]:
    return quantized_paths(config, spec) if load.quantization is not None and spec.quantize else (spec.path,)
