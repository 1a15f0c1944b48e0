"""The sharding rules: how the parameters' logical axes (declared in their architecture's
parameter table, `jaxpaged.config.architectures`) and the KV pool's are put on the mesh.

Megatron-style tensor parallelism over the mesh axis `TENSOR_AXIS`:

    q/k/v projections, gate/up     split over heads / kv heads / MLP width (column parallel)
    o_proj, down_proj              split over their input (row parallel: one all-reduce each)
    experts [E, ...]               every expert split over its FFN width, like the MLP; under
                                   expert parallelism whole experts, E / size per device (where
                                   size does not divide E, empty slots even them out:
                                   `empty_expert_slots`)
    embedding, LM head             split over the vocabulary (rows of the table / its columns)
    norms, o_bias                  replicated
    KV pool [L * NB, BS, K, H]     split over kv heads

Layer parameters stacked over the decoder layers (`[L, ...]`) lead with a `LAYERS` axis that is
never split; the engine's per-layer arrays are one layer's slice with one layer's sharding. The
pool holds every layer's blocks in a row.

With more devices than kv heads (Llama-3.1-70B has 8, Qwen2.5-7B 4), each kv head is repeated
`kv_replicas = N / K` times before splitting, so every device holds one kv head next to the
query heads that read it (device i's query heads belong to original kv head i // kv_replicas).

The runner's placement, the weight loader and `jaxpaged plan` all read these rules (no JAX here),
so what `plan` counts per GPU is what the engine puts there. A data-parallel mesh axis would be a
second entry of `MESH_AXES` that no parameter maps to.
"""

import dataclasses
import math

from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.spec import (
    EXPERT_MLP,
    EXPERTS,
    GROUP_AXES,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    MLP,
    SHARED_MLP,
    VOCAB,
    axis_sizes,
)
from jaxpaged.config.params.tables import find_state_param, state_params
from jaxpaged.parallel.pipeline import PipelineLayout

# Mesh axis names: declared once here. The pipeline axis is the outer one (a stage per host is
# the common layout across hosts: each host's devices are one stage's tensor-parallel group).
PIPELINE_AXIS = "pp"
TENSOR_AXIS = "tp"
MESH_AXES = (PIPELINE_AXIS, TENSOR_AXIS)

# Logical axes of the KV pool (the parameters' are declared with them, in jaxpaged.config.params.spec).
BLOCKS, SLOTS = "blocks", "slots"
# The pool's leading axis: every (virtual) layer's blocks in a row, split over the stages; and
# the pool's layers where an array has one axis for them (scales, blocks copied to the host).
LAYER_BLOCKS, POOL_LAYERS = "layer_blocks", "pool_layers"
# The leading axis of a per-layer parameter's slot array under pipeline parallelism: one layer
# per stage (see jaxpaged.parallel.pipeline).
STAGES = "stages"

# The K (or V) pool: every layer's blocks in a row.
KV_POOL_AXES = (LAYER_BLOCKS, SLOTS, KV_HEADS, HEAD_DIM)
# One stage's pool, as its layers see it (inside the stage nothing is split over the stages).
STAGE_POOL_AXES = (BLOCKS, SLOTS, KV_HEADS, HEAD_DIM)
# Scales of an fp8 KV pool, one per layer and kv head.
KV_SCALE_AXES = (POOL_LAYERS, KV_HEADS)
# Whole blocks copied to and from the host tier, `[C, 2, L, BS, K, H]`: K and V of every layer.
KV_BLOCK_AXES = (BLOCKS, None, POOL_LAYERS, SLOTS, KV_HEADS, HEAD_DIM)
# Step activations [T, N, H] of query heads and [T, K, H] of kv heads.
QUERY_AXES = (None, HEADS, HEAD_DIM)
KEY_VALUE_AXES = (None, KV_HEADS, HEAD_DIM)

# Logical axis -> mesh axis. Every split axis must divide evenly, except the vocabulary, which
# stays whole (replicated) when it does not.
# A mixture of experts' experts split like the MLP: each device holds every expert's share of
# the FFN width (and of the shared expert's); the router stays whole. A group-quantized weight's
# scales and zero points split where its first input axis does.
RULES: dict[str, str] = {
    HEADS: TENSOR_AXIS,
    KV_HEADS: TENSOR_AXIS,
    MLP: TENSOR_AXIS,
    VOCAB: TENSOR_AXIS,
    EXPERT_MLP: TENSOR_AXIS,
    SHARED_MLP: TENSOR_AXIS,
}
RULES |= {GROUP_AXES[a]: RULES[a] for a in GROUP_AXES if a in RULES}
# Pipeline parallelism: each stage holds its layers' weights and KV blocks.
RULES |= {STAGES: PIPELINE_AXIS, LAYER_BLOCKS: PIPELINE_AXIS, POOL_LAYERS: PIPELINE_AXIS}
# Expert parallelism (`enable_expert_parallel`): each device holds whole experts instead.
EXPERT_PARALLEL_RULES: dict[str, str | None] = {
    **RULES,
    EXPERTS: TENSOR_AXIS,
    EXPERT_MLP: None,
    GROUP_AXES[EXPERT_MLP]: None,
}


class TensorParallelError(ValueError):
    """A model that cannot be split over the requested number of devices (names the numbers)."""


@dataclasses.dataclass(frozen=True)
class TensorParallelLayout:
    """How one model splits over `size` devices.

    Args:
      config: the model as its checkpoint describes it.
      size: devices on the tensor-parallel axis.
      expert_parallel: a mixture of experts' experts split over the devices (E / size whole
        experts each, `EXPERT_PARALLEL_RULES`) instead of every expert's FFN width.
      pipeline: the decoder layers' stages (`PIPELINE_AXIS`); None: one stage. Each stage's
        `size` devices split its layers by the tensor-parallel rules.

    Raises:
      TensorParallelError: `size` does not divide the query heads or the MLP width, or neither of
        `size` and the kv heads divides the other; or the experts' FFN width (without expert
        parallelism); or (group-quantized weights) the groups of a split input (a quantization
        group never straddles two devices).
    """

    config: ModelConfig
    size: int = 1
    expert_parallel: bool = False
    pipeline: PipelineLayout | None = None

    def __post_init__(self):
        c, n = self.config, self.size
        if self.pipeline is None:
            object.__setattr__(self, "pipeline", PipelineLayout(c.num_layers))
        elif self.pipeline.num_layers != c.num_layers:
            raise TensorParallelError(
                f"a pipeline of {self.pipeline.num_layers} layers for {c.architecture}'s {c.num_layers}"
            )
        if not isinstance(n, int) or n < 1:
            raise TensorParallelError(f"tensor_parallel_size={n!r} must be a positive integer")
        if c.num_heads % n:
            raise TensorParallelError(f"tensor_parallel_size={n} must divide num_attention_heads={c.num_heads}")
        if c.num_kv_heads % n and n % c.num_kv_heads:
            raise TensorParallelError(
                f"tensor_parallel_size={n} and num_key_value_heads={c.num_kv_heads}: one must divide the other "
                "(kv heads are split over the devices, or repeated when there are more devices than kv heads)"
            )
        if c.intermediate_size % n:
            raise TensorParallelError(f"tensor_parallel_size={n} must divide intermediate_size={c.intermediate_size}")
        if self.expert_parallel and c.moe is None:
            raise TensorParallelError(
                f"tensor_parallel_size={n} with enable_expert_parallel: {c.architecture} has no experts; "
                "drop --enable-expert-parallel"
            )
        if c.moe is not None and c.moe.shared_expert_size % n:
            raise TensorParallelError(
                f"tensor_parallel_size={n} must divide the shared expert's FFN width ({c.moe.shared_expert_size})"
            )
        if self.expert_parallel and c.moe.num_experts < n:
            raise TensorParallelError(
                f"tensor_parallel_size={n} exceeds the number of experts ({c.moe.num_experts}) under expert "
                "parallelism (--enable-expert-parallel): every device holds whole experts, at least one; use at most "
                f"{c.moe.num_experts} devices, or split every expert's FFN width (drop --enable-expert-parallel)"
            )
        if self.expert_parallel and c.moe.empty_slots:
            raise TensorParallelError(
                "lay out the checkpoint's config, not a mesh layout's (it has empty expert slots)"
            )
        if c.moe is not None and not self.expert_parallel and c.moe.expert_size % n:
            raise TensorParallelError(
                f"tensor_parallel_size={n} must divide each expert's FFN width ({c.moe.expert_size}); "
                "or split whole experts with --enable-expert-parallel"
            )
        sizes = axis_sizes(c)
        held = {axis for p in state_params(c, quantized=True).values() for axis in p.axes}  # not a float one's
        for axis in GROUP_AXES.values():
            if self.rules.get(axis) == TENSOR_AXIS and axis in held and sizes[axis] % n:
                raise TensorParallelError(
                    f"tensor_parallel_size={n} would split a quantization group: the {axis.removesuffix('_groups')} "
                    f"inputs hold {sizes[axis]} groups of {c.weight_group_size} features, which {n} devices cannot "
                    "share evenly; use a tensor_parallel_size that divides it (or a smaller group size)"
                )

    @property
    def rules(self) -> dict[str, str | None]:
        """Logical axis -> mesh axis: `EXPERT_PARALLEL_RULES` under expert parallelism, else `RULES`."""
        return EXPERT_PARALLEL_RULES if self.expert_parallel else RULES

    @property
    def num_devices(self) -> int:
        """Devices of the mesh: `size` per stage."""
        return self.size * self.pipeline.size

    @property
    def kv_replicas(self) -> int:
        """How many devices hold each kv head (1 unless there are more devices than kv heads)."""
        return max(1, self.size // self.config.num_kv_heads)

    @property
    def empty_expert_slots(self) -> tuple[int, ...]:
        """Under expert parallelism over a device count that does not divide the E experts, the
        slots each device adds to hold as many as any other: ceil(E / size) slots a device, the
        first E % size devices all experts, the others one slot (their last) empty, so that no
        device holds two more experts than another (6 over 4: 2, 2, 1, 1; Qwen2-MoE's 60 over 8:
        8, 8, 8, 8, 7, 7, 7, 7). `()` where they divide, or without expert parallelism."""
        moe, n = self.config.moe, self.size
        if not self.expert_parallel or moe.num_experts % n == 0:
            return ()
        per_device = -(-moe.num_experts // n)
        return tuple(d * per_device + per_device - 1 for d in range(moe.num_experts % n, n))

    @property
    def mesh_config(self) -> ModelConfig:
        """The model as the mesh holds it (the same model): kv heads repeated `kv_replicas`
        times; the experts in their slots (`empty_expert_slots`)."""
        moe = self.config.moe
        if self.empty_expert_slots:
            moe = dataclasses.replace(moe, empty_slots=self.empty_expert_slots)
        return dataclasses.replace(self.config, num_kv_heads=self.config.num_kv_heads * self.kv_replicas, moe=moe)

    @property
    def device_config(self) -> ModelConfig:
        """One device's share of the heads and of the layers (what its KV pool and attention
        see): under pipeline parallelism its stage's layer slots (`PipelineLayout.max_layers`)."""
        mesh = self.mesh_config
        return dataclasses.replace(
            mesh,
            num_heads=mesh.num_heads // self.size,
            num_kv_heads=mesh.num_kv_heads // self.size,
            num_layers=self.pipeline.max_layers,
        )

    def axis_size(self, logical: str) -> int:
        """The global size of a logical axis in the mesh layout."""
        return axis_sizes(self.mesh_config)[logical]

    def mesh_axes(self, axes: tuple[str | None, ...]) -> tuple[str | None, ...]:
        """The mesh axis each logical axis is split over (None: whole on every device); the
        argument of a `PartitionSpec`."""
        split = {TENSOR_AXIS: self.size > 1, PIPELINE_AXIS: self.pipeline.size > 1}
        out = []
        for axis in axes:
            mesh_axis = self.rules.get(axis)
            mesh_axis = mesh_axis if split.get(mesh_axis, False) else None
            if mesh_axis is not None and axis == VOCAB and self.axis_size(VOCAB) % self.size:
                mesh_axis = None  # an uneven vocabulary stays whole
            out.append(mesh_axis)
        return tuple(out)

    def param_axes(self, path: tuple[str, ...]) -> tuple[str, ...]:
        """Logical axes of the parameter at `path` (its string keys in the model state, e.g.
        `("layers", "attn", "q_proj")`; per-layer parameters lead with `LAYERS`, stacked), from
        the architecture's parameter table.

        Raises:
          KeyError: a parameter the table does not know (every parameter must be in it).
        """
        return find_state_param(self.config, path).axes

    def param_mesh_axes(self, path: tuple[str, ...]) -> tuple[str | None, ...]:
        return self.mesh_axes(self.param_axes(path))

    def mesh_shape(self, path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
        """A checkpoint tensor's shape (in our layout) as the mesh holds it: kv axes repeated,
        the experts' axis with its empty slots."""
        grown = {KV_HEADS: lambda d: d * self.kv_replicas, EXPERTS: lambda d: d + len(self.empty_expert_slots)}
        return tuple(grown[a](d) if a in grown else d for a, d in zip(self.param_axes(path), shape))

    def device_shape(self, path: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
        """One device's shard of a checkpoint tensor of `shape` (in our layout); of a per-layer
        parameter (stacked, `[L, ...]`) its stage's layer slots (`PipelineLayout.max_layers`:
        every layer without pipeline parallelism)."""
        mesh_shape = self.mesh_shape(path, shape)
        axes = zip(self.param_axes(path), mesh_shape, self.param_mesh_axes(path))
        return tuple(self.pipeline.max_layers if a == LAYERS else d // self.size if m else d for a, d, m in axes)

    def device_elements(self, shapes: dict) -> int:
        """Elements one device holds of the parameters `{path: shape}`."""
        return sum(math.prod(self.device_shape(path, shape)) for path, shape in shapes.items())
