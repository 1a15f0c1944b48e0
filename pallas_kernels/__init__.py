"""Paged-attention kernels for NVIDIA GPUs, each beside a pure-jnp reference (`reference`)."""
