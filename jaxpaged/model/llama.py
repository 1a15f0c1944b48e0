"""Llama-family decoder (Llama, Mistral, Qwen2) in Flax NNX over a block-paged KV pool.

Dimension letters: T tokens in the step, D hidden, N query heads, K kv heads, H head_dim,
F MLP width, V vocabulary, NB pool blocks, BS block size.

Each layer projects q/k/v, rotates q/k, writes this step's K/V into its pool slots, then
attends over everything the pool holds for each sequence (write-then-attend). The pool comes
in and goes out as a value: under `jit` with the pool donated the update is in place.

The layers are one stacked module (every parameter has a leading layer axis L). The engine runs
them unrolled (`scan_layers=False`, its default) over per-layer arrays (`LayerArrays`, split from
the stacked ones once, outside the step), the layer body traced once and called per layer, so
every matmul reads its weight where it lies. `scan_layers=True` runs them as a `lax.scan` over
the stacked arrays: XLA compiles one layer body instead of L (programs compile several times
faster), but slices each layer's weights out of the stack every step, and those slices are
copies (on a CPU, and on an H100 before its Triton GEMMs: tests/gpu_compile). The pool
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

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

import pallas_kernels
from jaxpaged.config.attention import ATTENTION_BACKENDS
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.model.kv_pool import KVPool, KVQuant
from jaxpaged.model.layer_arrays import LayerArrays
from jaxpaged.model.metadata import AttentionMetadata
from jaxpaged.model.quant import matmul, quantize_weight, quantized_matmul
from jaxpaged.model.rope import apply_rope, inverse_frequencies
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.parallel.sharding import (KEY_VALUE_AXES, KV_HEADS, KV_POOL_AXES, QUANT_SUFFIX, QUANTIZED_INPUT_AXES,
                                        QUERY_AXES, SCALE_SUFFIX)  # fmt: skip
from pallas_kernels import reference

INIT_STDDEV = 0.02


def resolve_attention_backend(name: str) -> str:
    """"auto" is the Pallas kernels on a GPU and the jnp reference elsewhere; "pallas" on a
    CPU runs the kernels in interpret mode (slow; for tests)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not one of {ATTENTION_BACKENDS}")
    if name == "auto":
        return "pallas" if pallas_kernels.target_platform() == "gpu" else "reference"
    return name


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param(INIT_STDDEV * jax.random.normal(rngs.params(), shape, dtype))


def _weight(module: nnx.Module, name: str, rngs: nnx.Rngs, shape: tuple[int, ...], dtype, stack: tuple[int, ...],
            quantization: str | None) -> None:  # fmt: skip
    """Sets the weight `name` of `module` (our layout `[*stack, *in, *out]`): a plain parameter,
    or with `quantization` its quantized pair `<name>_quant`, `<name>_scale` (see quant.py)."""
    w = INIT_STDDEV * jax.random.normal(rngs.params(), (*stack, *shape), dtype)
    if quantization is None:
        setattr(module, name, nnx.Param(w))
        return
    q, scale = quantize_weight(w, quantization, QUANTIZED_INPUT_AXES[name], len(stack))
    setattr(module, name + QUANT_SUFFIX, nnx.Param(q))
    setattr(module, name + SCALE_SUFFIX, nnx.Param(scale))


def _project(module: nnx.Module, name: str, x: Float[Array, "T ..."]) -> Float[Array, "T ..."]:
    """`x [T, *in]` through the weight `name` of `module` (plain or quantized) -> `[T, *out]`."""
    num_in = QUANTIZED_INPUT_AXES[name]
    if module.quantization is None:
        return matmul(x, getattr(module, name)[...], num_in)
    q, scale = getattr(module, name + QUANT_SUFFIX)[...], getattr(module, name + SCALE_SUFFIX)[...]
    return quantized_matmul(x, q, scale, module.quantization, num_in)


class RMSNorm(nnx.Module):
    """`x / rms(x) * scale`, normalised in float32 and cast back before the scale (as HF does).

    Args:
      stack: leading axes of the scale (`(L,)` in the stacked layers).
    """

    def __init__(self, dim: int, eps: float, dtype, stack: tuple[int, ...] = ()):
        self.scale = nnx.Param(jnp.ones((*stack, dim), dtype))
        self.eps = eps

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...] * normed.astype(x.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention reading and writing one layer's blocks of the paged pool.

    Parameters are stacked over `stack` (the layers); a call sees one layer's slice.
    """

    def __init__(self, config: ModelConfig, dtype, *, rngs: nnx.Rngs, stack: tuple[int, ...],
                 attention: str = "reference", parallel: TensorParallel | None = None,
                 quantization: str | None = None):  # fmt: skip
        d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.quantization = quantization
        _weight(self, "q_proj", rngs, (d, n, h), dtype, stack, quantization)  # DNH
        _weight(self, "k_proj", rngs, (d, k, h), dtype, stack, quantization)  # DKH
        _weight(self, "v_proj", rngs, (d, k, h), dtype, stack, quantization)  # DKH
        _weight(self, "o_proj", rngs, (n, h, d), dtype, stack, quantization)  # NHD
        if config.qkv_bias:
            self.q_bias = nnx.Param(jnp.zeros((*stack, n, h), dtype))
            self.k_bias = nnx.Param(jnp.zeros((*stack, k, h), dtype))
            self.v_bias = nnx.Param(jnp.zeros((*stack, k, h), dtype))
        if config.o_bias:
            self.o_bias = nnx.Param(jnp.zeros((*stack, d), dtype))
        self.qkv_bias = config.qkv_bias
        self.has_o_bias = config.o_bias
        self.rope = config.rope
        self.head_dim = h
        self.attention = attention  # "reference" or "pallas" (resolved)
        self.parallel = parallel

    def __call__(
        self,
        x: Float[Array, "T D"],
        k_pool: Float[Array, "LNB BS K H"],
        v_pool: Float[Array, "LNB BS K H"],
        meta: AttentionMetadata,
        kv_quant: KVQuant | None = None,
    ) -> tuple[Float[Array, "T D"], Float[Array, "LNB BS K H"], Float[Array, "LNB BS K H"]]:
        """One layer over this step's tokens; `meta` addresses this layer's blocks of the pool
        (all layers' blocks in a row, `AttentionMetadata.for_layer`); `kv_quant`: this layer's
        scales of an fp8 pool (None: the pool holds the values as they are)."""
        q = _project(self, "q_proj", x)
        k = _project(self, "k_proj", x)
        v = _project(self, "v_proj", x)
        if self.qkv_bias:
            q, k, v = q + self.q_bias[...], k + self.k_bias[...], v + self.v_bias[...]
        inv_freq = jnp.asarray(inverse_frequencies(self.rope, self.head_dim))  # a trace-time constant
        q = apply_rope(q, meta.positions, inv_freq)
        k = apply_rope(k, meta.positions, inv_freq)
        k_scale, v_scale = (None, None) if kv_quant is None else (kv_quant.k_scale, kv_quant.v_scale)
        write = functools.partial(_write_kv, None if kv_quant is None else kv_quant.dtype)
        attend = functools.partial(paged_attention, pallas_kernels if self.attention == "pallas" else reference)
        if self.parallel is not None:  # each device writes and reads its own heads (and their scales)
            pool, sc = KV_POOL_AXES, (KV_HEADS,) if kv_quant is not None else ()
            write = self.parallel.per_head(write, (pool, pool, KEY_VALUE_AXES, KEY_VALUE_AXES, (), sc, sc), (pool, pool))
            attend = self.parallel.per_head(attend, (QUERY_AXES, pool, pool, (), sc, sc), QUERY_AXES)
        k_pool, v_pool = write(k_pool, v_pool, k, v, meta.slot_mapping, k_scale, v_scale)
        attn = attend(q, k_pool, v_pool, meta, k_scale, v_scale)
        out = _project(self, "o_proj", attn)
        if self.has_o_bias:
            out = out + self.o_bias[...]
        return out, k_pool, v_pool


def _write_kv(quant_dtype, k_pool, v_pool, k, v, slot_mapping, k_scale, v_scale):
    """The pool write, quantizing to `quant_dtype` with the `[K]` scales (None: as is)."""
    return pallas_kernels.write_kv(k_pool, v_pool, k, v, slot_mapping, k_scale=k_scale, v_scale=v_scale,
                                   quant_dtype=quant_dtype)  # fmt: skip


def paged_attention(
    ops,
    q: Float[Array, "T N H"],
    k_pool: Float[Array, "NB BS K H"],
    v_pool: Float[Array, "NB BS K H"],
    meta: AttentionMetadata,
    k_scale: Float[Array, " K"] | None = None,
    v_scale: Float[Array, " K"] | None = None,
) -> Float[Array, "T N H"]:
    """Attention of this step's queries over the pool (over whichever heads it is given: all of
    them, or one device's share under `shard_map`): the decode kernel for a decode program
    (`meta.decode_only`), else the ragged one, which serves any batch.

    There is no `lax.cond` choosing between them per step: a GPU conditional waits for its
    predicate on the host, and on CPU one over the pools copied every pool whose device holds a
    single kv head (XLA gave the operand another layout). The runner picks the program instead.

    Args:
      ops: `pallas_kernels` or `pallas_kernels.reference` (same functions, same results).
      k_scale, v_scale: scales of an fp8 pool, dequantized inside the kernels (None: 1).
    """
    if meta.decode_only:  # token i is sequence i's only query: decode attention, padded to T rows
        num_seqs = meta.kv_lens.shape[0]
        out = ops.paged_decode_attention(q[:num_seqs], k_pool, v_pool, meta.block_tables, meta.kv_lens,
                                         k_scale=k_scale, v_scale=v_scale)  # fmt: skip
        return jnp.pad(out, ((0, q.shape[0] - num_seqs), (0, 0), (0, 0)))
    return ops.ragged_paged_attention(q, k_pool, v_pool, meta.cu_q_lens, meta.kv_lens, meta.block_tables,
                                      meta.num_seqs, k_scale=k_scale, v_scale=v_scale)  # fmt: skip


class MLP(nnx.Module):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))` (parameters stacked over `stack`)."""

    def __init__(self, config: ModelConfig, dtype, *, rngs: nnx.Rngs, stack: tuple[int, ...],
                 quantization: str | None = None):  # fmt: skip
        d, f = config.hidden_size, config.intermediate_size
        self.quantization = quantization
        _weight(self, "gate_proj", rngs, (d, f), dtype, stack, quantization)  # DF
        _weight(self, "up_proj", rngs, (d, f), dtype, stack, quantization)  # DF
        _weight(self, "down_proj", rngs, (f, d), dtype, stack, quantization)  # FD

    def __call__(self, x: Float[Array, "T D"]) -> Float[Array, "T D"]:
        gate = _project(self, "gate_proj", x)
        up = _project(self, "up_proj", x)
        return _project(self, "down_proj", jax.nn.silu(gate) * up)


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: attention, then MLP. Built once for all layers (every parameter
    stacked `[L, ...]`); a call runs the one layer whose slice it is given (inside the scan)."""

    def __init__(self, config: ModelConfig, dtype, *, rngs: nnx.Rngs, attention: str,
                 parallel: TensorParallel | None = None, quantization: str | None = None):  # fmt: skip
        stack = (config.num_layers,)
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, stack)
        self.attn = Attention(config, dtype, rngs=rngs, stack=stack, attention=attention, parallel=parallel,
                              quantization=quantization)  # fmt: skip
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, stack)
        self.mlp = MLP(config, dtype, rngs=rngs, stack=stack, quantization=quantization)

    def __call__(self, x, k_pool, v_pool, meta: AttentionMetadata, kv_quant: KVQuant | None = None):
        attn, k_pool, v_pool = self.attn(self.input_norm(x), k_pool, v_pool, meta, kv_quant)
        x = x + attn
        x = x + self.mlp(self.post_attention_norm(x))
        return x, k_pool, v_pool


class Llama(nnx.Module):
    """The whole decoder. Parameter layouts are einsum-ready (see the comment on each).

    Args:
      config: the model's static configuration.
      dtype: parameter and activation dtype (float32 or bfloat16).
      rngs: random initialisation (used as-is for `load_format="dummy"`; replaced on load).
      attention: "auto", "reference" or "pallas" (see `resolve_attention_backend`).
      parallel: the mesh and sharding table under tensor parallelism; `config` is then the
        mesh layout (`parallel.layout.mesh_config`, kv heads repeated). None: one device.
      scan_layers: run the layers as a `lax.scan` (one compiled body, each layer's weights sliced
        out of the stack: copied); False unrolls them (L bodies: the same results, longer to
        compile), best over per-layer arrays (`unstack_layers` of the state, as the runner does).
      quantization: "fp8" or "int8" decoder-layer weights (see quant.py); None: `dtype` weights.
        The embedding, the norms and the LM head keep `dtype`.
    """

    def __init__(self, config: ModelConfig, dtype=jnp.float32, *, rngs: nnx.Rngs, attention: str = "auto",
                 parallel: TensorParallel | None = None, scan_layers: bool = True,
                 quantization: str | None = None):  # fmt: skip
        self.config = config
        self.parallel = parallel
        self.scan_layers = scan_layers
        backend = resolve_attention_backend(attention)
        self.embed = _param(rngs, (config.vocab_size, config.hidden_size), dtype)  # VD
        self.layers = DecoderLayer(config, dtype, rngs=rngs, attention=backend, parallel=parallel,
                                   quantization=quantization)  # stacked [L, ...]
        self.final_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = _param(rngs, (config.hidden_size, config.vocab_size), dtype)  # DV

    def __call__(
        self, token_ids: Int[Array, " T"], kv_pool: KVPool, meta: AttentionMetadata
    ) -> tuple[Float[Array, "T D"], KVPool]:
        """Runs every layer over this step's tokens.

        Returns:
          The final-normed hidden state of every token, and the updated pool.
        """
        table = self.embed[...]
        x = table[token_ids] if self.parallel is None else self.parallel.embed(table, token_ids)
        num_layers, num_blocks, block_size = kv_pool.num_layers, kv_pool.num_blocks, kv_pool.block_size
        graphdef, layer_params = nnx.split(self.layers)

        def one_layer(carry, per_layer):
            x, k_pool, v_pool = carry
            params, first_block, kv_quant = per_layer
            layer = nnx.merge(graphdef, params)
            return layer(x, k_pool, v_pool, meta.for_layer(first_block, block_size), kv_quant), None

        carry = (x, kv_pool.k, kv_pool.v)
        first_blocks = jnp.arange(num_layers, dtype=jnp.int32) * num_blocks
        per_layer = (layer_params, first_blocks, kv_pool.quant)  # the pool's scales: [L, K] -> [K] a layer
        if self.scan_layers:
            (x, k, v), _ = jax.lax.scan(one_layer, carry, per_layer)
        else:  # the same layers unrolled: one copy of the body per layer in the program, traced once
            # (every call of the jitted body hits its trace cache; XLA inlines the calls)
            traced_once = jax.jit(one_layer)
            for i in range(num_layers):
                layer = jax.tree.map(lambda a: a[i], per_layer, is_leaf=lambda a: isinstance(a, LayerArrays))
                carry, _ = traced_once(carry, layer)
            x, k, v = carry
        return self.final_norm(x), dataclasses.replace(kv_pool, k=k, v=v)

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
        return logits if self.parallel is None else self.parallel.replicate(logits)
