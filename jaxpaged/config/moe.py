"""Mixture-of-experts configuration: the router and expert sizes of Mixtral, Qwen2-MoE and
Qwen3-MoE, read from config.json. No JAX here.

Every decoder layer's MLP is a sparse block: a router (`gate`, `[D, E]`) scores the experts,
each token runs through its `top_k` best, and their outputs are summed with the router's
weights; Qwen2-MoE adds a shared expert whose output is scaled by `sigmoid(x . shared_gate)`.
Checkpoints whose layers mix dense and sparse MLPs (`decoder_sparse_step` > 1, `mlp_only_layers`)
are refused, naming the field.
"""

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, slots=True)
class MoeConfig:
    """The sparse MLP of every decoder layer (hashable, jit-static).

    Attributes:
      num_experts: E, routed experts per layer.
      top_k: experts each token runs through (`num_experts_per_tok`).
      expert_size: the width of one expert's FFN (Mixtral: `intermediate_size`; Qwen:
        `moe_intermediate_size`).
      normalize_top_k: the top-k router probabilities are renormalised to sum to one (Mixtral
        always; Qwen when `norm_topk_prob`).
      shared_expert_size: the width of Qwen2-MoE's gated shared expert; 0: none.
      weights_in_model_dtype: the router weights are cast to the model's dtype before scaling
        the experts' outputs (Qwen, as transformers does); Mixtral keeps them in float32.
      empty_slots: the expert slots of the mesh layout that hold no expert (zero weights, never
        routed to), added so that the devices of expert parallelism hold equal numbers of slots
        (`TensorParallelLayout.mesh_config`); the checkpoint's experts fill the others in order.
        `()` in a checkpoint's config.
    """

    num_experts: int
    top_k: int
    expert_size: int
    normalize_top_k: bool = True
    shared_expert_size: int = 0
    weights_in_model_dtype: bool = False
    empty_slots: tuple[int, ...] = ()

    @property
    def num_slots(self) -> int:
        """The experts' axis in the mesh layout: the experts and the empty slots."""
        return self.num_experts + len(self.empty_slots)

    @property
    def expert_slots(self) -> tuple[int, ...]:
        """The slot of each of the checkpoint's experts, in order."""
        empty = set(self.empty_slots)
        return tuple(s for s in range(self.num_slots) if s not in empty)

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be between 1 and the number of experts ({self.num_experts})"
            )


def moe_from_hf(kind: str, hf: dict[str, Any]) -> MoeConfig:
    """The sparse MLP a config.json of the given kind describes.

    Args:
      kind: "mixtral" or "qwen" (the architecture's `moe` field).
      hf: the parsed config.json.

    Raises:
      ValueError: naming a field whose value this engine would compute differently.
    """
    num_experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    if num_experts < 1:
        raise ValueError(f"num_experts={num_experts}: a mixture-of-experts model needs at least one expert")
    top_k = int(hf["num_experts_per_tok"])
    if kind == "mixtral":
        return MoeConfig(num_experts, top_k, int(hf["intermediate_size"]))
    if int(hf.get("decoder_sparse_step", 1)) != 1:
        raise ValueError(
            f"decoder_sparse_step={hf['decoder_sparse_step']} is not supported: jaxpaged runs models whose every "
            "layer is sparse (decoder_sparse_step=1)"
        )
    if hf.get("mlp_only_layers"):
        raise ValueError(
            f"mlp_only_layers={hf['mlp_only_layers']} is not supported: jaxpaged runs models whose every layer "
            "is sparse (mlp_only_layers=[])"
        )
    return MoeConfig(
        num_experts,
        top_k,
        int(hf["moe_intermediate_size"]),
        normalize_top_k=bool(hf.get("norm_topk_prob", False)),
        shared_expert_size=int(hf.get("shared_expert_intermediate_size") or 0),
        weights_in_model_dtype=True,
    )
