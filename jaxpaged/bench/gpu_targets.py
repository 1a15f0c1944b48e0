"""Compiling for a GPU this machine does not have (XLA's deviceless compilation).

XLA can compile a program for a GPU it is only told about: a topology of described devices
(`jax.experimental.topologies`), each with the facts its compiler reads (SM count, shared
memory, caches, bandwidth). Lowering and compiling over such devices gives the executable the
GPU would run (PTX compiled to cubin), its optimised HLO and its memory analysis, on a CPU:
what `jaxpaged bench startup --target h100` measures, and what the GPU-program tests inspect.
It needs JAX's CUDA plugin without the CUDA libraries (the gpu-compile extra,
i.e. `jax[cuda12-local]`), and no autotuning runs (that needs the device), so a compile on a
real GPU can take longer and pick other GEMM tilings.
"""

import contextlib
import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """The facts about one GPU model that XLA's GPU compiler reads (NVIDIA's published figures)."""

    description: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    memory_bandwidth: int  # bytes/s
    l2_cache_bytes: int
    clock_ghz: float
    shared_memory_per_sm: int = 228 * 1024
    shared_memory_per_block: int = 48 * 1024
    shared_memory_per_block_optin: int = 227 * 1024
    fp32_cores_per_sm: int = 128
    threads_per_sm: int = 2048
    threads_per_block: int = 1024
    registers_per_sm: int = 64 * 1024
    registers_per_block: int = 64 * 1024

    def target_config(self) -> str:
        """The spec as XLA's `GpuTargetConfigProto` text."""
        major, minor = self.compute_capability
        info = {
            "threads_per_block_limit": self.threads_per_block,
            "threads_per_warp": 32,
            "shared_memory_per_block": self.shared_memory_per_block,
            "shared_memory_per_core": self.shared_memory_per_sm,
            "threads_per_core_limit": self.threads_per_sm,
            "core_count": self.sm_count,
            "fpus_per_core": self.fp32_cores_per_sm,
            "block_dim_limit_x": 2**31 - 1,
            "block_dim_limit_y": 65535,
            "block_dim_limit_z": 65535,
            "memory_bandwidth": self.memory_bandwidth,
            "l2_cache_size": self.l2_cache_bytes,
            "clock_rate_ghz": self.clock_ghz,
            "device_memory_size": self.memory_bytes,
            "shared_memory_per_block_optin": self.shared_memory_per_block_optin,
            "registers_per_core_limit": self.registers_per_sm,
            "registers_per_block_limit": self.registers_per_block,
        }
        fields = "\n".join(f"  {name}: {value}" for name, value in info.items())
        capability = f"  cuda_compute_capability {{ major: {major} minor: {minor} }}"
        return (
            f'gpu_device_info {{\n{fields}\n{capability}\n}}\nplatform_name: "CUDA"\n'
            f'device_description_str: "{self.description}"\n'
        )


# The GPUs the project's device machines lend (H100 SXM 80 GB, H200 141 GB).
GPU_TARGETS = {
    "h100": GpuSpec(
        "NVIDIA H100 80GB HBM3",
        (9, 0),
        sm_count=132,
        memory_bytes=79 * 2**30 + 160 * 2**20,
        memory_bandwidth=3_350_000_000_000,
        l2_cache_bytes=50 * 2**20,
        clock_ghz=1.98,
    ),
    "h200": GpuSpec(
        "NVIDIA H200",
        (9, 0),
        sm_count=132,
        memory_bytes=139 * 2**30 + 800 * 2**20,
        memory_bandwidth=4_800_000_000_000,
        l2_cache_bytes=50 * 2**20,
        clock_ghz=1.98,
    ),
}


class GpuTargetError(ValueError):
    """Deviceless compilation is unavailable in this installation; the message says what to install."""


def prepare_environment() -> None:
    """Call before JAX starts its backends: the CUDA plugin then registers without CUDA's
    libraries or a driver (it otherwise refuses at its version check), and the local backend
    is the CPU."""
    import jax

    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    if jax.config.jax_platforms != "cpu":
        jax.config.update("jax_platforms", "cpu")


@contextlib.contextmanager
def compiling_for_target(name: str, count: int):
    """Inside this block programs trace and compile for `count` described GPUs `name` (a key of
    `GPU_TARGETS`); yields the devices to build the mesh of. The Pallas kernels are compiled by
    Triton for the GPU's compute capability (the default device is the first described one).

    Raises:
      KeyError: `name` is not a known target.
      GpuTargetError: JAX's CUDA plugin is missing (or JAX's backends started before
        `prepare_environment`), with the fix.
    """
    import jax
    from jax.experimental import topologies

    import pallas_kernels

    spec = GPU_TARGETS[name]
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology=f"1x1x{count}", target_config=spec.target_config()
        )
    except (NotImplementedError, RuntimeError) as err:
        raise GpuTargetError(
            f"--target {name}: compiling for a GPU this machine lacks needs JAX's CUDA plugin ({err}); install it "
            f"with pip install 'jax[cuda12-local]=={jax.__version__}' (no CUDA libraries needed), or "
            "pip install -e '.[gpu-compile]'"
        ) from None
    devices = list(topology.devices)
    with pallas_kernels.compiling_for("gpu"), jax.default_device(devices[0]):
        yield devices
