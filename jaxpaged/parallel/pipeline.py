"""Pipeline parallelism's layer split (no JAX): which decoder layers each stage holds.

The decoder layers are cut into `size` contiguous stages (balanced, the first stages taking one
more layer when the count does not divide, or as a partition says). A stage holds its layers'
weights and their KV blocks, on the devices of its row of the mesh (`PIPELINE_AXIS`).

In the step program every stage runs the same code (SPMD over the stage axis), so each stage
holds `max_layers` layer slots: a stage with fewer layers than the longest has empty slots at its
end, which hold zeros and pass activations through unchanged. Slot `j` of stage `s` is *virtual
layer* `s * max_layers + j`; the KV pool holds the blocks of every virtual layer in a row (see
jaxpaged.model.kv_pool), so under pipeline parallelism the pool's layer count is
`num_virtual_layers`, and its block axis is split over the stages.
"""

import dataclasses


class PipelineParallelError(ValueError):
    """A layer split that cannot be made (names the option and the numbers)."""


@dataclasses.dataclass(frozen=True)
class PipelineLayout:
    """The decoder layers split into contiguous stages.

    Args:
      num_layers: the model's decoder layers.
      size: stages (`pipeline_parallel_size`); 1: no pipeline.
      partition: layers per stage, first to last (`--pp-layer-partition`); None: balanced.
      microbatches: how many micro-batches a step's tokens are cut into at most (see
        `microbatches_for`); None: one per stage.

    Raises:
      PipelineParallelError: `size` is not a positive integer or exceeds the layers, or the
        partition does not give every stage at least one layer and all the layers.
    """

    num_layers: int
    size: int = 1
    partition: tuple[int, ...] | None = None
    microbatches: int | None = None

    def __post_init__(self):
        n, layers = self.size, self.num_layers
        if not isinstance(n, int) or n < 1:
            raise PipelineParallelError(f"pipeline_parallel_size={n!r} must be a positive integer")
        if n > layers:
            raise PipelineParallelError(
                f"pipeline_parallel_size={n} exceeds the model's {layers} decoder layers: every stage needs one"
            )
        if self.partition is None:
            return
        part = tuple(self.partition)
        if len(part) != n or any(not isinstance(p, int) or p < 1 for p in part) or sum(part) != layers:
            raise PipelineParallelError(
                f"pp_layer_partition={','.join(map(str, part))} must give each of the {n} stages "
                f"(pipeline_parallel_size) at least one layer and {layers} layers in all, e.g. "
                f"{','.join(map(str, balanced_partition(layers, n)))}"
            )
        object.__setattr__(self, "partition", part)

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        """Layers of each stage, first to last."""
        return self.partition or balanced_partition(self.num_layers, self.size)

    @property
    def stage_ranges(self) -> tuple[range, ...]:
        """The decoder layers of each stage."""
        out, start = [], 0
        for count in self.layers_per_stage:
            out.append(range(start, start + count))
            start += count
        return tuple(out)

    @property
    def max_layers(self) -> int:
        """Layer slots of every stage: its longest stage's layers."""
        return max(self.layers_per_stage)

    @property
    def num_virtual_layers(self) -> int:
        """Layer slots of all stages (the KV pool's layer count): `size * max_layers`."""
        return self.size * self.max_layers

    def stage_of(self, layer: int) -> int:
        """The stage that holds decoder layer `layer`."""
        return next(s for s, r in enumerate(self.stage_ranges) if layer in r)

    def slot_of(self, layer: int) -> int:
        """Decoder layer `layer`'s slot in its stage."""
        return layer - self.stage_ranges[self.stage_of(layer)].start

    def virtual_layer(self, layer: int) -> int:
        """Decoder layer `layer`'s virtual layer (its slot among all stages' slots)."""
        return self.stage_of(layer) * self.max_layers + self.slot_of(layer)

    def microbatches_for(self, num_tokens: int, decode: bool = False) -> int:
        """Micro-batches of a step of `num_tokens` (its bucket): the most, up to `microbatches`
        (default: one per stage), that divide the tokens evenly; one for a decode step.

        A step of M micro-batches over P stages runs M + P - 1 ticks, each stage working on one
        micro-batch (or idle) per tick: the idle share, the bubble, is (P - 1) / (M + P - 1).
        That pays where a tick's time follows its tokens (prefill: compute). A decode tick's time
        is its stage reading its weights, whatever the micro-batch: M micro-batches would read
        them M + P - 1 times a step instead of P, so a decode step is one micro-batch."""
        if decode:
            return 1
        target = self.microbatches or self.size
        return max(m for m in range(1, min(target, num_tokens) + 1) if num_tokens % m == 0)

    def layer_at(self, stage: int, slot: int) -> int | None:
        """The decoder layer in `slot` of `stage`, or None for an empty slot."""
        r = self.stage_ranges[stage]
        return r.start + slot if slot < len(r) else None


def balanced_partition(num_layers: int, size: int) -> tuple[int, ...]:
    """`num_layers` split into `size` stages differing by at most one layer, the first stages
    taking the extra ones."""
    base, extra = divmod(num_layers, size)
    return tuple(base + (s < extra) for s in range(size))


def parse_partition(text: str | None) -> tuple[int, ...] | None:
    """`--pp-layer-partition`'s value ("20,12": layers per stage) as a tuple; None or "" -> None.

    Raises:
      PipelineParallelError: a value that is not comma-separated integers, naming it.
    """
    if not text:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise PipelineParallelError(
            f"pp_layer_partition={text!r} must be comma-separated layer counts, one per stage, e.g. 20,12"
        ) from None
