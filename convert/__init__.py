"""Hugging Face safetensors -> jaxpaged (Orbax) weight conversion.

- `jaxpaged.checkpoint.hf_keys`: the explicit map from every HF tensor name to our parameter path,
  HF shape and layout transform, spelled out per layer from the `ModelConfig`.
- `jaxpaged.checkpoint.safetensors_index`: lazy, one-tensor-at-a-time reading of `model.safetensors` or a
  sharded `model.safetensors.index.json`, refusing tensors present in two shards.
- `convert.convert.convert_checkpoint`: writes `params/` (Orbax), the configs, the tokenizer
  files and a `jaxpaged_format.json` marker; `jaxpaged.checkpoint.loader.load_params` reads either form.
- `convert.cli`: the `jaxpaged-convert` console script.
"""
