"""Static descriptions, no JAX: the model's configuration (`model_config`), the engine's options
(`engine_args`, the one declaration behind `LLM(...)` and the CLI flags) and the model presets."""
