"""The files of a model directory, named once for the loader, the converter and argument checks.

A Hugging Face directory holds `config.json`, tokenizer files and one `model.safetensors` or a
`model.safetensors.index.json` naming its shards. A `jaxpaged-convert` directory holds the same
config and tokenizer files, an Orbax checkpoint under `params/` and the `jaxpaged_format.json`
marker (written last, so an interrupted conversion is never loadable). No JAX here.
"""

import os

from jaxpaged.config.presets import preset_tokenizer

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX_FILE = "model.safetensors.index.json"
FORMAT_FILE = "jaxpaged_format.json"
FORMAT_VERSION = 2  # 2: decoder layers stacked into one array per parameter
PARAMS_DIR = "params"
# Any of these means a Hugging Face tokenizer can be loaded from the directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
WEIGHT_FILES = (SAFETENSORS_FILE, SAFETENSORS_INDEX_FILE, FORMAT_FILE)


def _has_any(directory: str, names: tuple[str, ...]) -> bool:
    return any(os.path.isfile(os.path.join(directory, name)) for name in names)


def has_tokenizer(directory: str) -> bool:
    """Whether `directory` holds Hugging Face tokenizer files (nothing is ever downloaded)."""
    return _has_any(directory, TOKENIZER_FILES)


def tokenizer_dir(model: str, tokenizer: str | None = None) -> str | None:
    """The directory the tokenizer of `model` loads from: `tokenizer` when given, else the model
    directory when it holds tokenizer files, else (a preset) its packaged tokenizer where that is
    installed (see `jaxpaged.config.presets.PRESET_TOKENIZERS`); None when there is none."""
    if tokenizer:
        return tokenizer
    if os.path.isdir(model):
        return model if has_tokenizer(model) else None
    packaged = preset_tokenizer(model)
    return packaged.directory() if packaged is not None else None


def has_weights(directory: str) -> bool:
    """Whether `directory` holds safetensors weights or a jaxpaged-convert checkpoint."""
    return _has_any(directory, WEIGHT_FILES)
