"""The pieces of `benchmarks/gpu_run.py`: stage definitions, the step runner, the summary, the
ShareGPT and wheel preparation, and two stage scripts (`engine_start.py`, `serve_load.py`) that
run in processes of their own."""
