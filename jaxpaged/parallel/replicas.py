"""Which devices each data-parallel replica runs on (no JAX: set before it loads).

`jaxpaged serve --data-parallel-size N` runs N engine replicas, each in a process of its own
(`engine/core_process.py`) on its own `tensor_parallel_size x pipeline_parallel_size` GPUs:
replica r takes the r-th such group of the GPUs the server may use (`CUDA_VISIBLE_DEVICES`, or
all of them), and its process sees only those, so its JAX allocates memory on them alone (each
process preallocates most of every GPU it sees). On a CPU every replica sees the host's devices.
"""

import importlib.util
import os

from jaxpaged.config.checks import OptionError

# The JAX plugins that bring NVIDIA GPUs: with one installed, a replica on the CPU means its GPUs
# were missing (JAX falls back to the CPU with a warning).
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")


def replica_gpus(rank: int, devices_per_replica: int, size: int, visible: str | None) -> str:
    """The `CUDA_VISIBLE_DEVICES` of replica `rank` of `size`: its group of `devices_per_replica`
    among `visible` (the server's own `CUDA_VISIBLE_DEVICES`; None: GPUs 0, 1, ...).

    Raises:
      OptionError: `visible` lists fewer GPUs than `size` replicas need (naming
        `data_parallel_size`).
    """
    if visible is None or not visible.strip():
        gpus = [str(i) for i in range(size * devices_per_replica)]
    else:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    if len(gpus) < size * devices_per_replica:
        raise OptionError(
            "data_parallel_size",
            size,
            f"{size} replicas of {devices_per_replica} devices need {size * devices_per_replica} GPUs, but "
            f"CUDA_VISIBLE_DEVICES={visible!r} lists {len(gpus)}; lower --data-parallel-size or "
            "--tensor-parallel-size, or make more GPUs visible",
        )
    return ",".join(gpus[rank * devices_per_replica : (rank + 1) * devices_per_replica])


def restrict_to_replica_gpus(rank: int, devices_per_replica: int, size: int) -> None:
    """In replica `rank`'s process, before JAX loads: it sees only its GPUs."""
    visible = replica_gpus(rank, devices_per_replica, size, os.environ.get("CUDA_VISIBLE_DEVICES"))
    os.environ["CUDA_VISIBLE_DEVICES"] = visible


def check_replica_platform(rank: int, size: int, platform: str) -> None:
    """After JAX loaded in replica `rank`'s process: refuses a replica that fell back to the CPU
    although a GPU plugin is installed (its GPUs do not exist).

    Raises:
      OptionError: naming `data_parallel_size`.
    """
    if platform == "cpu" and any(importlib.util.find_spec(name) for name in CUDA_PLUGINS):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise OptionError(
            "data_parallel_size",
            size,
            f"replica {rank} was given the GPUs CUDA_VISIBLE_DEVICES={visible!r}, which JAX cannot open "
            "(it fell back to the CPU); lower --data-parallel-size or make more GPUs visible",
        )
