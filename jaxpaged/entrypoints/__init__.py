"""Front ends: the offline `LLM` API and the `jaxpaged` command line (`generate`, `plan`,
`serve`; the server itself is `jaxpaged.server`)."""
