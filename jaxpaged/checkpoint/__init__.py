"""Checkpoints on disk: the file names (`format`), the map from Hugging Face tensor names to
our parameter layout (`hf_keys`), reading safetensors (`safetensors_index`) and loading a
model into its devices (`loader`). `convert/` (the `jaxpaged-convert` tool) builds on these."""
