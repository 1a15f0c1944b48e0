"""Static descriptions, no JAX, that every other package may read: the model's configuration
(`model_config`), quantization methods and dtypes, the model presets, the speculative-decoding
configuration and the attention backends. The engine's options that combine them with the
other packages' rules are `jaxpaged.engine_args` and `jaxpaged.engine_config`."""
