"""The host side of the engine, plain Python and numpy (no JAX): sequences, the block manager
(paging and prefix caching), the scheduler (continuous batching, chunked prefill, preemption),
per-request output state and incremental detokenization."""
