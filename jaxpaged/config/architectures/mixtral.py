"""Mixtral: Llama's attention, and a sparse MLP in every layer (`jaxpaged.config.moe`): a router
`[D, E]` and E SwiGLU experts, stacked `[E, ...]` (the checkpoint stores each expert's `w1`
(gate), `w3` (up) and `w2` (down) separately); its `sliding_window` always applies.

Dimension letters: D hidden, E experts, F one expert's FFN width.
"""

from jaxpaged.config.architectures import Architecture
from jaxpaged.config.architectures.llama import LAYER, PARAMS, linear
from jaxpaged.config.params.spec import EMBED, EXPERT_MLP, EXPERTS, ParamSpec

MOE = ("layers", "moe")


def sparse_params(
    dense: tuple[ParamSpec, ...], block: str, router: str, experts: str, names, shared: tuple[ParamSpec, ...] = ()
) -> tuple[ParamSpec, ...]:
    """`dense` (a Llama-family table) with its MLP replaced, where it stands, by a router, stacked
    experts and `shared` (a shared expert's parameters).

    Args:
      block: the sparse block's checkpoint prefix, e.g. "block_sparse_moe.".
      router: the router's name under it; experts: each expert's prefix, with `{expert}`.
      names: the checkpoint names of the experts' gate, up and down projections.
    """
    gate, up, down = (LAYER + block + experts + name + ".weight" for name in names)
    sparse = (
        ParamSpec(MOE + ("router",), (EMBED, EXPERTS), LAYER + block + router + ".weight", "linear", 1),  # DE
        linear(MOE + ("gate_proj",), (EXPERTS, EMBED, EXPERT_MLP), gate),  # EDF
        linear(MOE + ("up_proj",), (EXPERTS, EMBED, EXPERT_MLP), up),  # EDF
        linear(MOE + ("down_proj",), (EXPERTS, EXPERT_MLP, EMBED), down),  # EFD
    )
    mlp = [i for i, p in enumerate(dense) if p.path[:2] == ("layers", "mlp")]
    return (*dense[: mlp[0]], *sparse, *shared, *dense[mlp[-1] + 1 :])


PARAMS = sparse_params(PARAMS, "block_sparse_moe.", "gate", "experts.{expert}.", ("w1", "w3", "w2"))

ARCHITECTURE = Architecture("mixtral", ("MixtralForCausalLM",), PARAMS, moe="mixtral")
