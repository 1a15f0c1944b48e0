"""Group-quantized products through the Pallas kernel under tensor parallelism: each device runs
the kernel over its own shard of the weight (`shard_map`), as the sharding table splits it.

Under GSPMD a Pallas call is opaque: XLA would gather its operands whole on every device. Here a
column-parallel weight (its outputs split: q/k/v, gate/up) gives each device its outputs' columns
from the whole activations; a row-parallel one (its inputs split: o, down) gives each device the
partial sums of its inputs' rows (their groups beside them: a group never spans devices, see
`jaxpaged.parallel.sharding`), summed over the tensor axis. Dimension letters: T tokens.
"""

import functools

import jax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float

from jaxpaged.config.params.spec import Path
from jaxpaged.model.group_quant import group_matmul
from jaxpaged.parallel.mesh import TensorParallel
from jaxpaged.parallel.sharding import TENSOR_AXIS, TensorParallelLayout


@functools.cache
def _layer_mesh_axes(layout: TensorParallelLayout, path: Path) -> tuple[str | None, ...]:
    """The mesh axes of one layer's array of the per-layer parameter at `path` (cached: every
    projection of every layer asks while each step program is traced)."""
    return layout.param_mesh_axes(path)[1:]


def kernel_on_every_device(
    parallel: TensorParallel,
    prefix: Path,
    codes: str,
    scale: str,
    zero: str,
    arrays: dict[str, Array],
    x: Float[Array, "T ..."],
) -> Float[Array, "T ..."]:
    """`x [T, *in]` times one layer's group-quantized weight `arrays[codes], arrays[scale],
    arrays[zero]` (state names under the module path `prefix`, e.g. `("layers", "mlp")`) through
    `pallas_kernels.group_quant_matmul` on every device of `parallel`'s mesh -> `[T, *out]`,
    split over the devices as the weight's outputs are (whole when its inputs are split)."""
    num_in = x.ndim - 1
    code_axes = _layer_mesh_axes(parallel.layout, (*prefix, codes))
    in_axes, out_axes = code_axes[:num_in], code_axes[num_in:]
    inputs_split = any(a is not None for a in in_axes)
    specs = tuple(PartitionSpec(*_layer_mesh_axes(parallel.layout, (*prefix, n))) for n in (codes, scale, zero))

    def local(q, s, z, x):
        y = group_matmul(x, q, s, z, num_in, kernel=True)
        return jax.lax.psum(y, TENSOR_AXIS) if inputs_split else y

    return jax.shard_map(
        local,
        mesh=parallel.mesh,
        in_specs=(*specs, PartitionSpec(None, *in_axes)),
        out_specs=PartitionSpec(None, *out_axes),
        check_vma=False,
    )(arrays[codes], arrays[scale], arrays[zero], x)
