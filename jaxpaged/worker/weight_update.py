"""New weights for a running engine (a trainer's update): checked, quantized where the engine
quantizes, placed with the engine's shardings, all before the runner's parameters are replaced.

Two forms come in (`new_params`):

- the parameter pytree as the engine holds it (`ModelRunner.params`, an `nnx.State`, or its
  `nnx.to_pure_dict`; per-layer arrays as `LayerArrays` or a list): every array, in the mesh
  layout (kv heads repeated, experts in their slots, as `get_params()` shows them), in the engine's dtype. An engine with
  quantized weights also takes a quantizable weight plain (`<name>` `[*in, *out]` in the model's
  dtype, what a trainer holds) instead of its pair, and quantizes it on the devices. A
  `jax.Array` already on the engine's devices with the engine's sharding is taken as it is (no
  copy); others are put there (host arrays copied once).
- Hugging Face `(name, array)` pairs (vLLM's `load_weights`), any subset of the checkpoint's
  tensors: each checked against the key map (`jaxpaged.checkpoint.hf_keys`), cast to the
  engine's dtype, put into our layout and the mesh layout, quantized where the engine quantizes;
  the parameters not named keep their values.

Everything is checked (paths, shapes, dtypes) before anything is placed, and placed before the
caller swaps: a refusal (`WeightUpdateError`, naming the path or tensor and what was expected)
leaves the engine as it was.
"""

import dataclasses
import difflib
import functools
import math
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.checkpoint.hf_keys import by_name, format_names, hf_key_specs, quantizable
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.tables import quantized_paths
from jaxpaged.model.quant import quantize_param
from jaxpaged.parallel.mesh import TensorParallel, param_path

Key = tuple[tuple[str, ...], int | None]  # (parameter path, layer of a per-layer array or None)


class WeightUpdateError(ValueError):
    """New weights that do not fit the engine: names the parameter (or HF tensor) and what was
    expected. Nothing was changed."""


@dataclasses.dataclass(frozen=True)
class WeightUpdateStats:
    """What an update did.

    Attributes:
      arrays: arrays of the engine's state replaced.
      shared_bytes: bytes of arrays taken as given (already on the devices with the engine's
        sharding: no copy).
      copied_bytes: bytes copied (host to device, or re-laid out between devices).
      quantized_bytes: bytes of plain weights quantized on the devices into their pairs.
    """

    arrays: int
    shared_bytes: int
    copied_bytes: int
    quantized_bytes: int


def _key(path) -> Key:
    """A leaf's key: its parameter path, and its index in a `LayerArrays` (or a list of per-layer
    arrays), if any."""
    last = path[-1] if path else None
    if isinstance(last, jax.tree_util.FlattenedIndexKey):
        return param_path(path), last.key
    if isinstance(last, jax.tree_util.SequenceKey):
        return param_path(path), last.idx
    return param_path(path), None


def flatten_params(tree) -> dict[Key, Any]:
    """`{(path, layer): array}` of a parameter pytree (an `nnx.State` or its pure dict)."""
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {_key(path): leaf for path, leaf in leaves}


def describe(key: Key) -> str:
    """`layers.attn.q_proj[3]` (layer 3's array) or `embed`."""
    path, layer = key
    return ".".join(path) + ("" if layer is None else f"[{layer}]")


def _bytes(x) -> int:
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class _Quantize:
    """A plain weight to quantize into the arrays at `keys` (its pair, or its group-quantized
    arrays: `quantized_paths`; `num_lead`: a stacked layer axis and an experts' axis)."""

    keys: tuple[Key, ...]
    num_in: int
    num_lead: int


class WeightTarget:
    """The engine's parameters as new weights must match them.

    Args:
      params: the runner's parameters (placed arrays).
      parallel: the mesh and sharding table.
      quantization: the engine's weight quantization ("fp8", "int8") or None.
    """

    def __init__(self, params, parallel: TensorParallel, quantization: str | None):
        self.parallel, self.quantization = parallel, quantization
        self.current = flatten_params(params)
        self.config: ModelConfig = parallel.layout.config  # the checkpoint's (not the mesh layout's)
        self.dtype = jnp.dtype(self.current[(("embed",), None)].dtype)
        self.plain: dict[Key, _Quantize] = {}  # a quantizable weight given plain -> its pair
        if quantization is not None:
            for key in self.current:
                path, layer = key
                if not path[-1].endswith("_quant"):
                    continue
                plain_path = path[:-1] + (path[-1].removesuffix("_quant"),)
                spec = quantizable(self.config, plain_path)
                keys = tuple((p, layer) for p in quantized_paths(self.config, spec))
                stacked = spec.per_layer and layer is None
                self.plain[(plain_path, layer)] = _Quantize(keys, spec.num_in, int(stacked) + spec.num_lead)

    def plain_shape(self, key: Key) -> tuple[int, ...]:
        """The mesh-layout shape of a quantizable weight given plain."""
        path, layer = key
        spec = quantizable(self.config, path)
        shape = spec.shape(self.parallel.layout.mesh_config)
        return (self.config.num_layers, *shape) if spec.per_layer and layer is None else shape

    # -- the pytree form ------------------------------------------------------------------------

    def from_tree(self, tree) -> tuple[dict[Key, jax.Array], WeightUpdateStats]:
        """Every array of the state from a parameter pytree, checked then placed (see the module
        docstring).

        Raises:
          WeightUpdateError: a missing or unexpected path, or a wrong shape or dtype.
        """
        given = flatten_params(tree)
        covered = set()
        for key in given:
            covered.update(self.plain[key].keys if key in self.plain else (key,))
        missing = [k for k in self.current if k not in covered]
        unexpected = [k for k in given if k not in self.current and k not in self.plain]
        if missing or unexpected:
            problems = [f"missing {format_names(map(describe, missing))}"] if missing else []
            problems += [f"unexpected {format_names(map(describe, unexpected))}"] if unexpected else []
            raise WeightUpdateError(
                "the new weights do not have the engine's structure (get_params()): " + "; ".join(problems)
            )
        for key, x in given.items():
            if key in self.plain:
                self._check(key, x, self.plain_shape(key), self.dtype, "plain weight to quantize")
            else:
                old = self.current[key]
                self._check(key, x, old.shape, old.dtype, "the engine's array")
        return self._place(given)

    @staticmethod
    def _check(key: Key, x, shape, dtype, what: str) -> None:
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise WeightUpdateError(f"parameter {describe(key)} is a {type(x).__name__}, expected an array")
        if tuple(x.shape) != tuple(shape) or np.dtype(x.dtype) != np.dtype(dtype):
            raise WeightUpdateError(
                f"parameter {describe(key)} is {np.dtype(x.dtype).name}{list(x.shape)}, expected "
                f"{np.dtype(dtype).name}{list(shape)} ({what})"
            )

    def _place(self, given: dict[Key, Any]) -> tuple[dict[Key, jax.Array], WeightUpdateStats]:
        """Each given array where the engine's lives (plain weights quantized into their pairs)."""
        new, shared, copied, quantized = {}, 0, 0, 0
        for key, x in given.items():
            if key in self.plain:
                job = self.plain[key]
                new.update(zip(job.keys, self._quantize(job, x)))
                quantized += _bytes(x)
                continue
            sharding = self.current[key].sharding
            if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
                new[key] = x  # where the engine's lives (the same devices and split): taken as it is
                shared += _bytes(x)
            else:
                new[key] = jax.device_put(x, sharding)
                copied += _bytes(x)
        return new, WeightUpdateStats(len(new), shared, copied, quantized)

    def _quantize(self, job: _Quantize, x) -> tuple[jax.Array, ...]:
        shardings = tuple(self.current[k].sharding for k in job.keys)
        return _quantizer(self.quantization, self.config, job.num_in, job.num_lead, shardings)(x)

    # -- the HF form ----------------------------------------------------------------------------

    def from_hf(self, weights: Iterable[tuple[str, Any]]) -> tuple[dict[Key, jax.Array], WeightUpdateStats]:
        """The arrays of the state that Hugging Face `(name, array)` pairs replace, checked then
        placed (the others keep theirs).

        Raises:
          WeightUpdateError: an unknown or repeated name, or a wrong shape or non-float dtype.
        """
        if self.config.moe is not None:
            raise WeightUpdateError(
                f"{self.config.architecture} is a mixture of experts: Hugging Face (name, array) pairs are not "
                "taken for its per-expert tensors yet; pass the engine's parameter pytree (get_params())"
            )
        specs = by_name(hf_key_specs(self.config))  # a fused tensor's parts share its name
        pairs, seen = [], set()
        for name, array in weights:
            if name not in specs:
                close = [n for n in specs if n.split(".")[-2:] == name.split(".")[-2:]][:3]
                close = close or difflib.get_close_matches(name, specs, n=3, cutoff=0.9)  # e.g. a fused tensor
                hint = f" (e.g. {', '.join(close)})" if close else ""
                raise WeightUpdateError(f"tensor {name!r} is not a parameter of this {self.config.architecture}{hint}")
            if name in seen:
                raise WeightUpdateError(f"tensor {name!r} is given twice")
            seen.add(name)
            if not jnp.issubdtype(array.dtype, jnp.floating):
                raise WeightUpdateError(f"tensor {name!r} is {np.dtype(array.dtype).name}, expected a float array")
            try:
                specs[name][0].check(tuple(array.shape))
            except ValueError as err:
                raise WeightUpdateError(str(err).split("; ")[0]) from None
            pairs += [(spec, array) for spec in specs[name]]
        new: dict[Key, jax.Array] = {}
        copied = quantized = 0
        for spec, array in pairs:
            value = spec.transform(np.asarray(array), self.dtype)  # our layout, one layer's (host)
            copied += value.nbytes
            value = self.parallel.to_mesh_layout(spec.target, value, one_layer=spec.layer is not None)
            plain = quantizable(self.config, spec.target) if self.quantization is not None else None
            if plain is None:
                parts = [(spec.target, value)]
            else:
                quantized += value.nbytes
                arrays = quantize_param(jnp.asarray(value), self.quantization, self.config, plain.num_in)
                parts = zip(quantized_paths(self.config, plain), arrays)
            for path, part in parts:
                if (path, spec.layer) in self.current:  # an array of its own (a layer's, or a whole parameter)
                    key = (path, spec.layer)
                    new[key] = jax.device_put(part, self.current[key].sharding)
                else:  # a row of a stacked parameter
                    key = (path, None)
                    base = new.get(key, self.current[key])
                    if isinstance(base, jax.ShapeDtypeStruct):  # asleep at level 2: no values kept
                        base = _zeros(base)
                    new[key] = _set_row(base, jax.device_put(part, _row_sharding(base)), spec.layer)
        return new, WeightUpdateStats(len(new), 0, copied, quantized)


def _zeros(shape: jax.ShapeDtypeStruct) -> jax.Array:
    return jax.jit(lambda: jnp.zeros(shape.shape, shape.dtype), out_shardings=shape.sharding)()


def _row_sharding(stacked: jax.Array):
    """One row's sharding of a stacked array (its leading layer axis dropped)."""
    spec = stacked.sharding.spec
    return jax.sharding.NamedSharding(stacked.sharding.mesh, jax.sharding.PartitionSpec(*tuple(spec)[1:]))


@jax.jit
def _set_row_jit(stacked, row, index):
    return jax.lax.dynamic_update_index_in_dim(stacked, row.astype(stacked.dtype), index, 0)


def _set_row(stacked: jax.Array, row: jax.Array, layer: int) -> jax.Array:
    """A new stacked array with row `layer` replaced (the old one is left as it was)."""
    return _set_row_jit(stacked, row, jnp.int32(layer))


@functools.lru_cache(maxsize=64)
def _quantizer(method: str, config: ModelConfig, num_in: int, num_lead: int, shardings: tuple):
    """The jitted quantization of one weight straight into its arrays' shardings."""
    fn = functools.partial(quantize_param, method=method, config=config, num_in=num_in, num_lead=num_lead)
    return jax.jit(fn, out_shardings=shardings)


def replace_params(params, new: dict[Key, jax.Array]):
    """The parameter state with the arrays at `new`'s keys replaced (the others kept)."""

    def pick(path, leaf):
        return new.get(_key(path), leaf)

    return jax.tree_util.tree_map_with_path(pick, params)
