"""Default sampling parameters from a model's `generation_config.json` (vLLM's
`--generation-config`). No JAX here.

`auto` (the default) reads the model directory's file, a directory reads that directory's, and
`vllm` ignores the file. The keys vLLM takes from it, and only those, become defaults of every
request that does not set them (`LLM.generate` without `sampling_params`, `jaxpaged generate`
without the flag, a server request without the field): `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, and `max_new_tokens` as `max_tokens`.
"""

import json
import os

GENERATION_CONFIG_MODES = ("auto", "vllm")
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(model_dir: str, generation_config: str) -> dict:
    """The `SamplingParams` fields the model's generation config sets (empty for `vllm`, or when
    the file is missing or sets none).

    Args:
      model_dir: the model directory (or a preset name: no file).
      generation_config: "auto", "vllm" or a directory holding generation_config.json.

    Raises:
      ValueError: a directory given without the file, or a file that is not a JSON object.
    """
    if generation_config == "vllm":
        return {}
    directory = model_dir if generation_config == "auto" else generation_config
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        if generation_config != "auto":
            raise ValueError("that directory holds no generation_config.json")
        return {}
    with open(path) as f:
        try:
            config = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err.msg})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object")
    return {field: config[key] for key, field in SAMPLING_KEYS.items() if config.get(key) is not None}
