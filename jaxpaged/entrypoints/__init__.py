"""Front ends below the server and the benchmarks: the offline `LLM` API, the engine flags every
command shares (`cli_flags`), `jaxpaged generate` and `jaxpaged-convert`. The `jaxpaged` command
itself, which also dispatches to `jaxpaged.server` and `jaxpaged.bench`, is `jaxpaged.cli`."""
