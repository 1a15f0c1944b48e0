"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3; with moe.py's sparse MLP Mixtral,
Qwen2-MoE, Qwen3-MoE) in Flax NNX over a block-paged KV pool.

Dimension letters: T tokens in the step, D hidden, N query heads, K kv heads, H head_dim,
F MLP width, V vocabulary, NB pool blocks, BS block size.

Each layer projects q/k/v, rotates q/k, writes this step's K/V into its pool slots, then
attends over everything the pool holds for each sequence (write-then-attend). The pool comes
in and goes out as a value: under `jit` with the pool donated the update is in place.

The layers are one module whose parameters exist once per layer: with `scan_layers=False` (the
default: `jaxpaged.config.defaults`) as per-layer arrays (`LayerArrays`, from creation and load
onward: never stacked), the layers unrolled, the layer body traced once and called per layer, so
every matmul reads its weight where it lies. `scan_layers=True` stacks them (a leading layer axis
L) and runs the layers as a `lax.scan` over the stacked arrays: XLA compiles one layer body
instead of L (programs compile several times faster), but slices each layer's weights out of
the stack every step, and those slices are copies (on a CPU, and on an H100 before its Triton GEMMs: tests/gpu_compile). The pool
`[L * NB, BS, K, H]` is carried through the layers whole; layer l's blocks are `l * NB + block`
(see kv_pool.py), so the kernels read and write one layer's blocks with offset block ids, and
nothing slices a layer's pool out of it (no copy).

Under tensor parallelism (`parallel`, see jaxpaged.parallel) the parameters arrive split over
the mesh by the sharding table; the pool write and the attention each run on every device over
its own heads (`shard_map`), XLA adds the all-reduce after o_proj and down_proj, the embedding lookup
is vocabulary-parallel and the logits are gathered whole for the sampler.
"""

import dataclasses
import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

import pallas_kernels
from jaxpaged.config import defaults
from jaxpaged.config.architectures import ARCHITECTURES
from jaxpaged.config.hf_config import SUPPORTED_ACTIVATIONS
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.spec import KV_HEADS, ParamSpec, Path
from jaxpaged.config.params.tables import param_specs, quantized_paths
from jaxpaged.model.attention import BACKENDS, paged_attention, resolve_attention_backend
from jaxpaged.model.kv_pool import KVPool, KVQuant
from jaxpaged.model.layer_arrays import LayerArrays
from jaxpaged.model.lora import LayerLora, LoraPool, lora_delta, token_onehot
from jaxpaged.model.metadata import AttentionMetadata
from jaxpaged.model.moe import SparseMoe
from jaxpaged.model.pipeline_carry import PipelineCarry, Stages, empty_carry, tick
from jaxpaged.model.quant import project, quantize_param
from jaxpaged.model.rope import apply_rope, inverse_frequencies
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.parallel.pipeline import PipelineLayout
from jaxpaged.parallel.sharding import KEY_VALUE_AXES, QUERY_AXES, STAGE_POOL_AXES

INIT_STDDEV = 0.02
INIT_CHUNK = 1 << 22  # elements of random values made at once (see `initial_value`)


def use_group_kernel(parallel: TensorParallel | None) -> bool:
    """Whether group-quantized weights multiply through the Pallas kernel (in every step): on a
    GPU, on one device or over every device's shard under tensor parallelism
    (`group_kernel_parallel`), but not with tensor and pipeline parallelism together; XLA's
    product elsewhere."""
    if pallas_kernels.target_platform() != "gpu":
        return False
    return parallel is None or parallel.size == 1 or parallel.layout.pipeline.size == 1


def group_kernel_parallel(parallel: TensorParallel | None) -> TensorParallel | None:
    """The mesh the group-quantized kernel runs on every device of (`shard_map`), when tensor
    parallelism splits the weights and the kernel is used; None: one device, or no kernel."""
    if parallel is None or parallel.size == 1 or not use_group_kernel(parallel):
        return None
    return parallel


def initial_value(spec: ParamSpec, config: ModelConfig, dtype, key: jax.Array, layer=None) -> jax.Array:
    """A parameter's initial value (one layer's, for a per-layer parameter): `INIT_STDDEV` x
    normal values from `key` folded with the parameter's path and `layer`, or ones, or zeros.

    Each value depends only on the key, the path and the layer, never on which other parameters
    the model holds, in what order they are made, or whether the layers are stacked: so a model
    made whole (`Llama`) and one made a parameter and a layer at a time (dummy weights,
    `jaxpaged.engine.setup`) hold the same values.

    Args:
      spec: the parameter's declaration.
      config: the model's configuration (its shape's sizes).
      dtype: the value's dtype.
      key: the model's random key.
      layer: the decoder layer (an int or a traced int32) of a per-layer parameter; else None.
    """
    shape = spec.shape(config)
    if spec.init != "normal":
        return (jnp.ones if spec.init == "ones" else jnp.zeros)(shape, dtype)
    key = jax.random.fold_in(key, zlib.crc32("/".join(spec.path).encode()) % 2**31)  # stable across processes
    if layer is not None:
        key = jax.random.fold_in(key, layer)
    # Made in chunks of whole rows (row chunk i from key i): the generator's temporaries, several
    # times the values' bytes on a CPU, stay a chunk's.
    rows, row_elements = shape[0], math.prod(shape[1:])
    chunks = next((c for c in range(1, rows + 1) if rows % c == 0 and rows // c * row_elements <= INIT_CHUNK), rows)

    def rows_chunk(i):
        return INIT_STDDEV * jax.random.normal(jax.random.fold_in(key, i), (rows // chunks, *shape[1:]), dtype)

    if chunks == 1:
        return rows_chunk(0)
    return jax.lax.map(rows_chunk, jnp.arange(chunks)).reshape(shape)


class ParamDeclarer:
    """Creates a model's parameters from its architecture's table (`jaxpaged.config.architectures`) while its
    modules are built: each module asks for the parameters under its own path.

    Args:
      config: the model's configuration (the mesh layout's under tensor parallelism).
      dtype: the parameters' dtype (a quantized pair keeps its own).
      rngs: random initialisation of the "normal" parameters (one key drawn; see `initial_value`).
      quantization: "fp8", "int8" or a group-quantized method: quantizable weights become their
        quantized pair (triple when `config.weight_group_size` is set).
      per_layer_arrays: per-layer parameters as `LayerArrays` (one array per layer, for unrolled
        layers) instead of stacked `[L, ...]` (for a scan). The values are the same either way.
      pipeline: the layers' stages; with several, `LayerArrays` of the stages' layer slots,
        slot j's array `[P, ...]` holding each stage's j-th layer (zeros in an empty slot).
      group_kernel: the modules multiply group-quantized weights through the Pallas kernel in
        every step (`jaxpaged.model.group_quant.group_matmul`).
      kernel_parallel: under tensor parallelism, the mesh the kernel runs on every device of
        (`group_kernel_parallel`); each module gets it with its table path (`declare`).
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype,
        rngs: nnx.Rngs,
        quantization: str | None,
        per_layer_arrays: bool = False,
        pipeline: PipelineLayout | None = None,
        group_kernel: bool = False,
        kernel_parallel: TensorParallel | None = None,
    ):
        self.config, self.dtype, self.key, self.quantization = config, dtype, rngs.params(), quantization
        self.group_kernel, self.kernel_parallel = group_kernel, kernel_parallel
        self.per_layer_arrays = per_layer_arrays
        self.pipeline = pipeline if pipeline is not None and pipeline.size > 1 else None
        self.specs = param_specs(config)
        self.declared: set[Path] = set()

    def declare(self, module: nnx.Module, prefix: Path) -> None:
        """Sets on `module` every parameter of the table whose path is `prefix` and one name:
        per-layer ones stacked `[L, ...]` or as `LayerArrays`, quantizable ones as their pair
        under quantization; and `param_prefix`, `kernel_parallel` (see `project`)."""
        module.param_prefix, module.kernel_parallel = prefix, self.kernel_parallel
        for spec in self.specs:
            if spec.path[:-1] != prefix:
                continue
            if not spec.per_layer:
                values = [self._values(spec, None)]
            elif self.pipeline is not None:  # per layer slot: the stages' layers stacked
                values = [self._slot_values(spec, slot) for slot in range(self.pipeline.max_layers)]
            else:  # per layer: the array or its pair
                values = [self._values(spec, layer) for layer in range(self.config.num_layers)]
            names = [path[-1] for path in quantized_paths(self.config, spec)] if len(values[0]) > 1 else [spec.name]
            for i, name in enumerate(names):
                if not spec.per_layer:
                    value = values[0][i]
                elif self.per_layer_arrays:
                    value = LayerArrays(v[i] for v in values)
                else:
                    value = jnp.stack([v[i] for v in values])
                setattr(module, name, nnx.Param(value))
            self.declared.add(spec.path)

    def _values(self, spec: ParamSpec, layer: int | None) -> tuple[jax.Array, ...]:
        value = initial_value(spec, self.config, self.dtype, self.key, layer)
        if self.quantization is not None and spec.quantize:
            return quantize_param(value, self.quantization, self.config, spec.num_in, spec.num_lead)
        return (value,)

    def _slot_values(self, spec: ParamSpec, slot: int) -> tuple[jax.Array, ...]:
        """Layer slot `slot` of every stage, stacked `[P, ...]` (zeros where a stage has none)."""
        stages = range(self.pipeline.size)
        per_stage = [self.pipeline.layer_at(stage, slot) for stage in stages]
        values = [None if layer is None else self._values(spec, layer) for layer in per_stage]
        some = next(v for v in values if v is not None)
        return tuple(
            jnp.stack([jnp.zeros_like(some[i]) if v is None else v[i] for v in values]) for i in range(len(some))
        )

    def has(self, prefix: Path) -> bool:
        """Whether the table declares a parameter under `prefix` (an optional module's)."""
        return any(spec.path[:-1] == prefix for spec in self.specs)

    def check_all_declared(self) -> None:
        """Raises naming every parameter of the table no module asked for."""
        missing = [".".join(s.path) for s in self.specs if s.path not in self.declared]
        if missing:
            raise ValueError(
                f"the {self.config.architecture} parameter table declares {missing}, which no module "
                "of the model holds: add them to the model or remove them from the table"
            )


def _is_layer_arrays(x) -> bool:
    return isinstance(x, LayerArrays)


def rms_norm(
    x: Float[Array, "... D"], scale: Float[Array, " D"], eps: float, unit_offset: bool = False
) -> Float[Array, "... D"]:
    """`x / rms(x) * scale` over the last axis, normalised in float32 and cast back before the
    scale (as HF does for Llama); with `unit_offset`, `x / rms(x) * (1 + scale)` all in float32,
    then cast (Gemma)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    if unit_offset:
        return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
    return scale * normed.astype(x.dtype)


class RMSNorm(nnx.Module):
    """`rms_norm` with the table's `scale` under `prefix` (stacked `[L, D]` in the layers), its
    scale offset by one where the architecture's norms are (`Architecture.unit_offset_norms`)."""

    def __init__(self, params: ParamDeclarer, prefix: Path, eps: float):
        params.declare(self, prefix)
        self.eps = eps
        self.unit_offset = ARCHITECTURES[params.config.architecture].unit_offset_norms

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        return rms_norm(x, self.scale[...], self.eps, self.unit_offset)


class Attention(nnx.Module):
    """Grouped-query self-attention reading and writing one layer's blocks of the paged pool.

    Parameters are stacked over the layers; a call sees one layer's slice.
    """

    def __init__(
        self,
        config: ModelConfig,
        params: ParamDeclarer,
        *,
        attention: str = "reference",
        parallel: TensorParallel | None = None,
    ):
        params.declare(self, ("layers", "attn"))  # q/k/v/o projections, biases, q/k norms (see the table)
        self.quantization, self.group_kernel = params.quantization, params.group_kernel
        # the optional parameters the table gave this architecture and config
        self.qkv_bias = hasattr(self, "q_bias")
        self.has_o_bias = hasattr(self, "o_bias")
        self.qk_norm = hasattr(self, "q_norm")  # Qwen3: an RMSNorm over each head's q and k before RoPE
        self.unit_offset = ARCHITECTURES[config.architecture].unit_offset_norms
        self.eps = config.rms_norm_eps
        # every layer's window and rotary embedding, where all layers share them; else the layer's
        # own arrive with each call (`LayerAttention`)
        self.window, self.rope = config.window_of(0), config.rope_of(0)
        self.scale = config.softmax_scale
        self.head_dim = config.head_dim
        self.attention = attention  # "reference" or "pallas" (resolved)
        self.parallel = parallel

    def __call__(
        self,
        x: Float[Array, "T D"],
        k_pool: Float[Array, "LNB BS K H"],
        v_pool: Float[Array, "LNB BS K H"],
        meta: AttentionMetadata,
        kv_quant: KVQuant | None = None,
        own: "LayerAttention | None" = None,
        lora: LayerLora | None = None,
    ) -> tuple[Float[Array, "T D"], Float[Array, "LNB BS K H"], Float[Array, "LNB BS K H"]]:
        """One layer over this step's tokens; `meta` addresses this layer's blocks of the pool
        (all layers' blocks in a row, `AttentionMetadata.for_layer`); `kv_quant`: this layer's
        scales of an fp8 pool (None: the pool holds the values as they are); `own`: this layer's
        window and inverse frequencies where the layers differ (None: the shared ones); `lora`:
        this layer's LoRA adapters and the tokens' slots (None: none)."""
        q = project(self, "q_proj", x) + lora_delta(lora, "q_proj", x)
        k = project(self, "k_proj", x) + lora_delta(lora, "k_proj", x)
        v = project(self, "v_proj", x) + lora_delta(lora, "v_proj", x)
        if self.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        if self.qk_norm:
            q = rms_norm(q, self.q_norm[...], self.eps, self.unit_offset)
            k = rms_norm(k, self.k_norm[...], self.eps, self.unit_offset)
        if own is None:  # trace-time constants
            window, inv_freq = self.window, jnp.asarray(inverse_frequencies(self.rope, self.head_dim))
        else:
            window, inv_freq = own.window, own.inv_freq
        q = apply_rope(q, meta.positions, inv_freq, self.rope.attention_factor)
        k = apply_rope(k, meta.positions, inv_freq, self.rope.attention_factor)
        k_scale, v_scale = (None, None) if kv_quant is None else (kv_quant.k_scale, kv_quant.v_scale)
        write = functools.partial(_write_kv, None if kv_quant is None else kv_quant.dtype)
        attend = functools.partial(paged_attention, BACKENDS[self.attention], scale=self.scale, window=window)
        if self.parallel is not None:  # each device writes and reads its own heads (and their scales)
            pool, sc = STAGE_POOL_AXES, (KV_HEADS,) if kv_quant is not None else ()  # a layer sees its stage's pool
            write = self.parallel.per_head(
                write, (pool, pool, KEY_VALUE_AXES, KEY_VALUE_AXES, (), sc, sc), (pool, pool)
            )
            attend = self.parallel.per_head(attend, (QUERY_AXES, pool, pool, (), sc, sc), QUERY_AXES)
        k_pool, v_pool = write(k_pool, v_pool, k, v, meta.slot_mapping, k_scale, v_scale)
        attn = attend(q, k_pool, v_pool, meta, k_scale, v_scale)
        out = project(self, "o_proj", attn) + lora_delta(lora, "o_proj", attn)
        if self.has_o_bias:
            out = out + self.o_bias[...]
        return out, k_pool, v_pool


def _write_kv(quant_dtype, k_pool, v_pool, k, v, slot_mapping, k_scale, v_scale):
    """The pool write, quantizing to `quant_dtype` with the `[K]` scales (None: as is)."""
    return pallas_kernels.write_kv(
        k_pool, v_pool, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale, quant_dtype=quant_dtype
    )


# config.json's activation names (the list config reading accepts) -> the function
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": functools.partial(jax.nn.gelu, approximate=True)}
assert tuple(ACTIVATIONS) == SUPPORTED_ACTIVATIONS, "an activation config reading accepts has no function here"


class MLP(nnx.Module):
    """Gated feed-forward: `down(act(gate(x)) * up(x))`, act SiLU (SwiGLU) or GELU-tanh
    (`ModelConfig.hidden_act`; parameters stacked over the layers)."""

    def __init__(self, params: ParamDeclarer):
        params.declare(self, ("layers", "mlp"))  # gate_proj [D, F], up_proj [D, F], down_proj [F, D]
        self.quantization, self.group_kernel = params.quantization, params.group_kernel
        self.act = params.config.hidden_act

    def __call__(self, x: Float[Array, "T D"], lora: LayerLora | None = None) -> Float[Array, "T D"]:
        gate = project(self, "gate_proj", x) + lora_delta(lora, "gate_proj", x)
        up = project(self, "up_proj", x) + lora_delta(lora, "up_proj", x)
        hidden = ACTIVATIONS[self.act](gate) * up
        return project(self, "down_proj", hidden) + lora_delta(lora, "down_proj", hidden)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention, then MLP, each output normed again where the table
    declares `attn_out_norm` / `mlp_out_norm` (Gemma 3). Built once for all layers (every
    parameter stacked `[L, ...]`, or per-layer arrays); a call runs the one layer it is given."""

    def __init__(
        self, config: ModelConfig, params: ParamDeclarer, *, attention: str, parallel: TensorParallel | None = None
    ):
        self.input_norm = RMSNorm(params, ("layers", "input_norm"), config.rms_norm_eps)
        self.attn = Attention(config, params, attention=attention, parallel=parallel)
        self.post_attention_norm = RMSNorm(params, ("layers", "post_attention_norm"), config.rms_norm_eps)
        for name in ("attn_out_norm", "mlp_out_norm"):
            if params.has(("layers", name)):
                setattr(self, name, RMSNorm(params, ("layers", name), config.rms_norm_eps))
        if config.moe is None:
            self.mlp = MLP(params)
        else:  # a mixture of experts (moe.py)
            self.moe = SparseMoe(config, params, parallel, kernels=BACKENDS[attention].kernels)

    def __call__(
        self, x, k_pool, v_pool, meta: AttentionMetadata, kv_quant: KVQuant | None = None, own=None, lora=None
    ):
        attn, k_pool, v_pool = self.attn(self.input_norm(x), k_pool, v_pool, meta, kv_quant, own, lora)
        x = x + (self.attn_out_norm(attn) if hasattr(self, "attn_out_norm") else attn)
        normed = self.post_attention_norm(x)
        out = self.moe(normed) if hasattr(self, "moe") else self.mlp(normed, lora)
        x = x + (self.mlp_out_norm(out) if hasattr(self, "mlp_out_norm") else out)
        return x, k_pool, v_pool


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """One layer's own sliding window and rotary frequencies, for models whose layers differ
    (Gemma 3's local and global layers), stacked `[L, ...]` over the layers by `of`."""

    window: Int[Array, "*L"]  # `NO_WINDOW` for a full layer; L: stacked, or one layer's
    inv_freq: Float[Array, "*L R2"]

    @staticmethod
    def of(config: ModelConfig) -> "LayerAttention | None":
        """Every layer's, stacked; None where the layers are alike (`ModelConfig.layers_alike`:
        then both are trace-time constants of the one layer body)."""
        if config.layers_alike:
            return None
        windows = [config.window_of(i) for i in range(config.num_layers)]
        windows = [pallas_kernels.NO_WINDOW if w is None else w for w in windows]
        freqs = [inverse_frequencies(config.rope_of(i), config.head_dim) for i in range(config.num_layers)]
        return LayerAttention(jnp.asarray(windows, jnp.int32), jnp.asarray(np.stack(freqs)))


def _one_layer(
    graphdef, block_size: int, carry, params, first_block, kv_quant, meta: AttentionMetadata, own=None, lora=None
):
    """Decoder layer `params` (one layer's, merged with the layers' `graphdef`) over `carry`
    `(x, k_pool, v_pool)`, addressing the pool's blocks from `first_block`; `own`: the layer's
    `LayerAttention` (None: the layers are alike); `lora`: the layer's `LayerLora` (None: none)."""
    x, k_pool, v_pool = carry
    layer = nnx.merge(graphdef, params)
    return layer(x, k_pool, v_pool, meta.for_layer(first_block, block_size), kv_quant, own, lora)


class Llama(nnx.Module):
    """The whole decoder. Parameter layouts are einsum-ready (see the comment on each).

    Args:
      config: the model's static configuration.
      dtype: parameter and activation dtype (float32 or bfloat16).
      rngs: random initialisation (`initial_value`: `load_format="dummy"` makes the same values
        from `nnx.Rngs(seed)`; replaced on load).
      attention: "auto", "reference" or "pallas" (see `resolve_attention_backend`).
      parallel: the mesh and sharding table under tensor parallelism; `config` is then the
        mesh layout (`parallel.layout.mesh_config`, kv heads repeated). None: one device.
      scan_layers: stack the layers' parameters and run the layers as a `lax.scan` (one compiled
        body, each layer's weights sliced out of the stack: copied); False holds them as per-layer
        arrays and unrolls the layers (L bodies: the same results, longer to compile).
      quantization: "fp8" or "int8" decoder-layer weights (see quant.py), or group-quantized ones
        (`config.weight_group_size`, see group_quant.py); None: `dtype` weights.
        The embedding, the norms and the LM head keep `dtype`.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype=jnp.float32,
        *,
        rngs: nnx.Rngs,
        attention: str = "auto",
        parallel: TensorParallel | None = None,
        scan_layers: bool = defaults.SCAN_LAYERS,
        quantization: str | None = None,
    ):
        self.config = config
        self.parallel = parallel
        self.scan_layers = scan_layers
        pipeline = None if parallel is None else parallel.layout.pipeline
        self.pipeline = pipeline if pipeline is not None and pipeline.size > 1 else None
        if self.pipeline is not None and not config.layers_alike:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline.size} with a {config.architecture} model whose layers "
                "differ in sliding window or rotary embedding is not supported yet; use tensor parallelism"
            )
        if self.pipeline is not None and scan_layers:
            raise ValueError(
                f"scan_layers=True with pipeline_parallel_size={self.pipeline.size}: a stage runs its layer slots "
                "unrolled; build the model with scan_layers=False"
            )
        backend = resolve_attention_backend(attention)
        params = ParamDeclarer(
            config,
            dtype,
            rngs,
            quantization,
            per_layer_arrays=not scan_layers,
            pipeline=pipeline,
            group_kernel=use_group_kernel(parallel),
            kernel_parallel=group_kernel_parallel(parallel),
        )
        params.declare(self, ())  # the embedding [V, D] and, unless tied, the LM head [D, V]
        self.layers = DecoderLayer(config, params, attention=backend, parallel=parallel)  # stacked [L, ...]
        self.final_norm = RMSNorm(params, ("final_norm",), config.rms_norm_eps)
        params.check_all_declared()

    def __call__(
        self,
        token_ids: Int[Array, " T"],
        kv_pool: KVPool,
        meta: AttentionMetadata,
        lora: tuple[LoraPool, Int[Array, " T"]] | None = None,
    ) -> tuple[Float[Array, "T D"], KVPool]:
        """Runs every layer over this step's tokens; `lora`: the LoRA adapter pool and each
        token's slot in it (None: the base model for every token).

        Returns:
          The final-normed hidden state of every token, and the updated pool.
        """
        x = self._embed(token_ids)
        graphdef, layer_params = nnx.split(self.layers)
        if self.pipeline is not None:
            if lora is not None:
                raise ValueError("LoRA adapters under pipeline parallelism are not supported yet")
            x, k, v = self._pipelined(graphdef, layer_params, x, kv_pool, meta)
            return self.final_norm(x), dataclasses.replace(kv_pool, k=k, v=v)
        num_layers, num_blocks, block_size = kv_pool.num_layers, kv_pool.num_blocks, kv_pool.block_size
        onehot = None
        if lora is not None:
            pool, slots = lora
            onehot = token_onehot(slots, next(iter(pool.b.values())).shape[1], x.dtype)
            lora = (pool.a, pool.b)

        def one_layer(carry, per_layer):
            params, first_block, kv_quant, own, adapters = per_layer
            layer_lora = None if adapters is None else LayerLora(*adapters, onehot)
            return _one_layer(graphdef, block_size, carry, params, first_block, kv_quant, meta, own, layer_lora), None

        carry = (x, kv_pool.k, kv_pool.v)
        first_blocks = jnp.arange(num_layers, dtype=jnp.int32) * num_blocks
        # the pool's scales: [L, K] -> [K] a layer; the layers' own windows and frequencies; the
        # layer's adapters
        per_layer = (layer_params, first_blocks, kv_pool.quant, LayerAttention.of(self.config), lora)
        if self.scan_layers:
            if any(map(_is_layer_arrays, jax.tree.leaves(layer_params, is_leaf=_is_layer_arrays))):
                raise ValueError(
                    "scan_layers=True needs the layers' parameters stacked; this model holds them as "
                    "per-layer arrays: build it with scan_layers=True"
                )
            (x, k, v), _ = jax.lax.scan(one_layer, carry, per_layer)
        else:  # the same layers unrolled: one copy of the body per layer in the program, traced once
            # (every call of the jitted body hits its trace cache; XLA inlines the calls)
            traced_once = jax.jit(one_layer)
            for i in range(num_layers):
                layer = jax.tree.map(lambda a: a[i], per_layer, is_leaf=_is_layer_arrays)
                carry, _ = traced_once(carry, layer)
            x, k, v = carry
        return self.final_norm(x), dataclasses.replace(kv_pool, k=k, v=v)

    def _embed(self, token_ids: Int[Array, " T"]) -> Float[Array, "T D"]:
        """The tokens' embeddings (vocabulary-parallel under tensor parallelism), times
        `sqrt(hidden_size)` in their dtype where the architecture scales them."""
        table = self.embed[...]
        x = table[token_ids] if self.parallel is None else self.parallel.embed(table, token_ids)
        if ARCHITECTURES[self.config.architecture].scaled_embeddings:
            x = x * jnp.asarray(self.config.hidden_size**0.5, x.dtype)
        return x

    def _stages(self, graphdef, layer_params, kv_pool: KVPool) -> Stages:
        """The layer slots as one tick's program over every stage (`pipeline_carry.Stages`)."""
        layer = jax.jit(functools.partial(_one_layer, graphdef, kv_pool.block_size))  # traced once
        return Stages(self.pipeline, self.parallel.mesh, layer, layer_params, kv_pool)

    def _pipelined(
        self, graphdef, layer_params, x: Float[Array, "T D"], kv_pool: KVPool, meta: AttentionMetadata
    ) -> tuple[Float[Array, "T D"], Float[Array, "LNB BS K H"], Float[Array, "LNB BS K H"]]:
        """The layers as a pipeline over the stages (pipeline parallelism): the step's tokens cut
        into M micro-batches (`PipelineLayout.microbatches_for`: one for a decode step), run in
        M + P - 1 ticks (`pipeline_carry.tick`, the one `pipeline_tick` runs), from an empty
        carry to an empty carry.

        At tick t stage s runs its layer slots over micro-batch t - s (an idle stage runs them
        with its K/V writes sent to the null block, and its result is dropped); between ticks
        every stage hands its activations to the next (the stage axis of `[P, T / M, D]`
        shifted by one: a collective permute). The last stage's result of each micro-batch goes to
        every stage (the LM head is on all of them).
        """
        pipe = self.pipeline
        num_micro = pipe.microbatches_for(x.shape[0], decode=meta.decode_only)
        micro = [meta.microbatch(m, num_micro) for m in range(num_micro)]
        xs = x.reshape(num_micro, -1, x.shape[1])
        stages = self._stages(graphdef, layer_params, kv_pool)
        k, v = stages.split_pool(kv_pool)
        carry = empty_carry(pipe.size, x.shape[1], x.dtype, micro[0])
        outputs = []
        for t in range(num_micro + pipe.size - 1):
            entering = t < num_micro
            fed, fed_meta = (xs[t], micro[t]) if entering else (jnp.zeros_like(xs[0]), micro[-1])
            out, _, carry, k, v = tick(stages, carry, fed, fed_meta, entering, k, v)
            if t >= pipe.size - 1:
                outputs.append(out)
        pool = stages.join_pool(kv_pool, k, v)
        return jnp.concatenate(outputs), pool.k, pool.v

    def init_pipeline_carry(self, meta: AttentionMetadata) -> PipelineCarry:
        """An empty carry for `pipeline_tick` (pipeline parallelism), for micro-batches shaped as
        `meta` (its tokens, sequence rows, pages and `decode_only`)."""
        if self.pipeline is None:
            raise ValueError("init_pipeline_carry needs pipeline parallelism (pipeline_parallel_size > 1)")
        return empty_carry(self.pipeline.size, self.config.hidden_size, self.dtype, meta)

    def pipeline_tick(
        self,
        carry: PipelineCarry,
        token_ids: Int[Array, " Tm"],
        kv_pool: KVPool,
        meta: AttentionMetadata,
        entering=True,
    ) -> tuple[Float[Array, "Tm D"], jax.Array, PipelineCarry, KVPool]:
        """One pipeline tick with the micro-batches in flight carried from call to call
        (pipeline parallelism): the micro-batch `token_ids` (its tokens, embedded here) enters
        stage 0 with `meta` when `entering` (a bool, Python or traced; False while the pipeline
        drains: stage 0 idles, `token_ids` and `meta` only give shapes); every stage s > 0 runs
        its layer slots over the micro-batch `carry` holds for it; the last stage's micro-batch
        leaves; every other moves on one stage. A stage with no micro-batch writes no K/V and
        its result is dropped (`PipelineCarry.busy`). The tick is `_pipelined`'s: M micro-batches
        fed through M + P - 1 ticks from `init_pipeline_carry` give `_pipelined`'s hidden states
        (in order, one per tick from tick P - 1) and pool.

        Every micro-batch of a carry has the same shapes (tokens, sequence rows, pages) and the
        same `decode_only` (the stages run one program); a sequence's micro-batches enter in
        order, and its K/V written at stage s by one micro-batch is there for its next one,
        since each stage runs the micro-batches in the order they entered.

        Returns:
          The leaving micro-batch's hidden states, final-normed (`compute_logits`' input; zeros
          when none left: the pipeline filling), whether one left, the next carry, and the pool.

        Raises:
          ValueError: no pipeline parallelism, or a micro-batch not shaped as the carry's.

        The engine's steps under pipeline parallelism are these ticks
        (`functional.forward_tick`, run by `jaxpaged.worker.pipelined_runner.PipelinedRunner`,
        whose module doc says how the runner and the scheduler keep P groups of sequences in
        flight, and when the pipeline drains).
        """
        if self.pipeline is None:
            raise ValueError("pipeline_tick needs pipeline parallelism (pipeline_parallel_size > 1)")
        x = self._embed(token_ids)
        graphdef, layer_params = nnx.split(self.layers)
        stages = self._stages(graphdef, layer_params, kv_pool)
        k, v = stages.split_pool(kv_pool)
        out, exited, carry, k, v = tick(stages, carry, x, meta, entering, k, v)
        hidden = jnp.where(exited, self.final_norm(out), jnp.zeros_like(out))
        return hidden, exited, carry, stages.join_pool(kv_pool, k, v)

    @property
    def pool_config(self) -> ModelConfig:
        """The model as its KV pool sees it (`init_kv_pool`): its layers are the decoder layers,
        or under pipeline parallelism every stage's layer slots (`num_virtual_layers`)."""
        if self.pipeline is None:
            return self.config
        return dataclasses.replace(self.config, num_layers=self.pipeline.num_virtual_layers)

    @property
    def dtype(self):
        """The parameters' (and activations') dtype; also of a model of shapes (`nnx.eval_shape`)."""
        return self.embed.get_value().dtype

    def compute_logits(self, hidden: Float[Array, "T D"]) -> Float[Array, "T V"]:
        """Float32 logits for the given hidden states (LM head, or the tied embedding)."""
        if self.config.tie_word_embeddings:
            logits = jnp.einsum("TD,VD->TV", hidden, self.embed[...], preferred_element_type=jnp.float32)
        else:
            logits = jnp.einsum("TD,DV->TV", hidden, self.lm_head[...], preferred_element_type=jnp.float32)
        logits = logits.astype(jnp.float32)
        return logits if self.parallel is None else self.parallel.replicate(self.parallel.vocab_split(logits))
