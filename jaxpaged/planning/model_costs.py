"""What one device step of a model costs in bytes and FLOPs, from its configuration (no JAX).

    weight bytes read per step = the parameters on the GPU (`plan.weight_bytes_per_gpu`), less the
                                 embedding table (a step gathers T of its rows) unless the LM head
                                 is the same table
    GEMM FLOPs per token       = 2 x the parameters one token computes with (`plan.count_active_parameters`)
                                 outside the embedding and the LM head
    LM-head FLOPs per row      = 2 x hidden x vocabulary, for each sampled row (S of them)
    KV bytes per token         = `model_config.kv_bytes_per_token` (2 x layers x KV heads x head_dim x dtype bytes)
    attention FLOPs            = 4 x query heads x head_dim per (query, visible key) pair per layer

A mixture of experts is priced as if every step read all its experts (true of large batches).
"""

import dataclasses

from jaxpaged.config.hf_config import model_config_from_hf
from jaxpaged.config.model_config import kv_bytes_per_token
from jaxpaged.config.presets import load_config_dict
from jaxpaged.config.quantization import DTYPE_BYTES
from jaxpaged.planning.plan import MODEL_DTYPES, count_active_parameters, weight_bytes_per_gpu

# Llama-3.1-8B's vocabulary: what `sampler_row_s` in step_cost.py was measured with.
REFERENCE_VOCAB = 128256


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """A model's per-step sizes for the cost model.

    Attributes:
      name: the model as given.
      weight_read_bytes: bytes of weights every step reads.
      gemm_flops_per_token: FLOPs of the decoder's matrices per token.
      head_flops_per_row: FLOPs of the LM head per sampled row.
      kv_bytes_per_token: KV-cache bytes of one token over all layers.
      num_layers, num_heads, head_dim: attention's shape.
      vocab_size: the vocabulary (the sampler's rows scale with it).
      max_context_len: the model's longest context.
    """

    name: str
    weight_read_bytes: int
    gemm_flops_per_token: int
    head_flops_per_row: int
    kv_bytes_per_token: int
    num_layers: int
    num_heads: int
    head_dim: int
    vocab_size: int
    max_context_len: int

    def attention_flops(self, pairs: int) -> float:
        """FLOPs of attention over `pairs` (query, visible key) pairs in every layer."""
        return 4.0 * self.num_heads * self.head_dim * pairs * self.num_layers


def model_costs(model: str, dtype: str = "bfloat16") -> ModelCosts:
    """The costs of a preset or a directory with config.json, weights and KV cache in `dtype`.

    Raises:
      ValueError: an unknown model, or a dtype outside `MODEL_DTYPES`.
    """
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"--dtype {dtype}: the throughput model prices {', '.join(MODEL_DTYPES)}")
    name, raw = load_config_dict(model)
    config = model_config_from_hf(raw)
    element = DTYPE_BYTES[dtype]
    table = config.vocab_size * config.hidden_size
    embed_bytes = 0 if config.tie_word_embeddings else table * element
    head_params = 0 if config.tie_word_embeddings else table
    return ModelCosts(
        name=name,
        weight_read_bytes=weight_bytes_per_gpu(config, dtype, None, 1) - embed_bytes,
        gemm_flops_per_token=2 * (count_active_parameters(config) - table - head_params),
        head_flops_per_row=2 * table,
        kv_bytes_per_token=kv_bytes_per_token(config, element),
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        vocab_size=config.vocab_size,
        max_context_len=config.max_context_len,
    )
