"""`jaxpaged bench`: vLLM's benchmark commands (throughput, latency, serve, plot, startup).

See `jaxpaged.bench.cli` for the command line; the serving client (`serve`, `serve_client`,
`metrics`, `datasets`) imports no JAX, so it can load any OpenAI-compatible server.
"""
