"""The GPUs the throughput model knows: their published figures and what was measured on them.

Published: NVIDIA's datasheets (SXM parts, dense bf16 tensor-core peak, i.e. half the figure
"with sparsity"). Measured: `benchmarks/results/h100_2026-11-26/` (the H100's copy bandwidth,
`kernels.json`) and DESIGN.md section 8 (the H200's copy bandwidth and a bf16 8192^3 matmul). A
GPU nothing was measured on gets the H100's ratio of copy to published bandwidth, and says so.

The engine's efficiencies (what fraction of these a GEMM or an attention kernel reaches) are
not the GPU's: they are the calibrated `StepCosts` of `step_cost.py`, applied to every GPU.
"""

import dataclasses

GB = 1e9
TFLOPS = 1e12

# The H100's measured in-place copy (read + write of 2 GiB; kernels.json "hbm_copy_Bps") over its
# published 3.35 TB/s: what an estimated GPU's copy bandwidth is scaled by.
H100_COPY_OF_PUBLISHED = 2987 / 3350


@dataclasses.dataclass(frozen=True)
class GpuDescription:
    """One GPU model, as the throughput model prices it.

    Attributes:
      name: the key (`--gpu`).
      description: the device kind JAX reports (vLLM's batch limits look at it: an A100 keeps the
        small ones).
      memory_bytes: memory the engine sizes its pool from (JAX's view of the device; for the lent
        kinds the figures of `jaxpaged.bench.gpu_targets.GPU_TARGETS`, which tests check agree).
      hbm_bandwidth: published HBM bandwidth, bytes/s.
      bf16_peak_flops: published dense bf16 tensor-core peak, FLOP/s.
      copy_bandwidth: a device-to-device copy's bandwidth, bytes/s: measured, or estimated.
      copy_source: where `copy_bandwidth` comes from.
      matmul_flops: a measured large bf16 matmul's FLOP/s, or None (a check, not used in costs).
      matmul_source: where `matmul_flops` comes from.
    """

    name: str
    description: str
    memory_bytes: int
    hbm_bandwidth: float
    bf16_peak_flops: float
    copy_bandwidth: float
    copy_source: str
    matmul_flops: float | None = None
    matmul_source: str = ""


GPUS = {
    "h100": GpuDescription(
        "h100",
        "NVIDIA H100 80GB HBM3",
        memory_bytes=79 * 2**30 + 160 * 2**20,
        hbm_bandwidth=3350 * GB,  # H100 SXM5 datasheet
        bf16_peak_flops=989.4 * TFLOPS,  # H100 SXM5 datasheet, dense
        copy_bandwidth=2987 * GB,
        copy_source="measured: benchmarks/results/h100_2026-11-26/kernels.json, hbm_copy_Bps (an in-place copy of 2 GiB)",
    ),
    "h200": GpuDescription(
        "h200",
        "NVIDIA H200",
        memory_bytes=139 * 2**30 + 800 * 2**20,
        hbm_bandwidth=4800 * GB,  # H200 SXM datasheet
        bf16_peak_flops=989.4 * TFLOPS,  # H200 SXM datasheet, dense (the H100's tensor cores)
        copy_bandwidth=4300 * GB,
        copy_source="measured: ~4.3 TB/s device-to-device copy on the lent H200 (DESIGN.md section 8)",
        matmul_flops=790 * TFLOPS,
        matmul_source="measured: ~790 TFLOP/s bf16 8192^3 matmul on the lent H200 (DESIGN.md section 8)",
    ),
    "a100": GpuDescription(
        "a100",
        "NVIDIA A100-SXM4-80GB",
        memory_bytes=80 * 2**30,
        hbm_bandwidth=2039 * GB,  # A100 80GB SXM datasheet
        bf16_peak_flops=312 * TFLOPS,  # A100 datasheet, dense
        copy_bandwidth=2039 * GB * H100_COPY_OF_PUBLISHED,
        copy_source="estimated: the published 2,039 GB/s x the H100's measured copy / published (0.89); "
        "nothing measured on an A100",
    ),
}


def get_gpu(name: str) -> GpuDescription:
    """The description of `--gpu name`.

    Raises:
      ValueError: an unknown name, listing the known ones.
    """
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"--gpu {name}: unknown GPU; known: {', '.join(GPUS)}") from None
