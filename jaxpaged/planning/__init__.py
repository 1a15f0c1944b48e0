"""Memory planning, no JAX: sizing the KV pool (`memory`) and `jaxpaged plan` (`plan`), which
does the engine's arithmetic for a model and a GPU without either."""
