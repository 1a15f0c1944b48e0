"""The pieces of the one-call GPU runs (`benchmarks/gpu_run.py`, `quantization_gpu.py`,
`speculative_gpu.py`).

Shared by all three: `orchestrate.py` (the stage runner: flags, device probe, stages in order with
budgets that add up, the summary after every stage), `stage.py` (one stage's clock, steps and
files), `runner.py` (one step: a process group with a timeout), `plan.py` (what every plan has)
and `summary.py` (summary.json, summary.md's head, the tarball).

Each run's own: its stage list and plan (in its script), its summary table (`gpu_run_summary.py`,
`quant_summary.py`, `spec_summary.py`) and the scripts its steps run in processes of their own
(`gpu_run_stages.py` with `engine_start.py`, `serve_load.py` and `prepare.py`; `quant_hlo.py`,
`hlo_census.py`, `quant_kernels.py`; `spec_latency.py`).
"""
