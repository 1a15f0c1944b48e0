"""Benchmark scripts and the GPU runs (`gpu/`), each a module run from the repository's root as
`python -m benchmarks.NAME` (`python -m benchmarks.gpu.NAME`): the checkout's `jaxpaged` and the
helpers beside each script import without installing anything. The results are in `results/`."""
