"""The architectures jaxpaged runs: one module each, the one place an architecture is declared.

Each module of this package declares `ARCHITECTURE`, an `Architecture`: its Hugging Face class
names (config.json's `architectures`), how its config.json differs from Llama's, and its
parameter table (`jaxpaged.config.params.spec.ParamSpec`s). The package finds its modules itself, so
a new dense architecture is a module here plus what its forward pass does differently in
`jaxpaged/model/llama.py`; the model, sharding, checkpoint map, conversion and `jaxpaged plan`
follow from the table. No JAX here.
"""

import dataclasses
import importlib
import pkgutil

from jaxpaged.config.params.spec import ParamSpec

BIAS_RULES = ("attention_bias", "qkv", "qkv_bias")
MOE_KINDS = ("mixtral", "qwen")  # how config.json describes the experts (jaxpaged.config.moe)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One architecture.

    Attributes:
      name: `ModelConfig.architecture`.
      hf_names: the config.json `architectures` entries that mean it.
      params: its parameter table, in the model state's order.
      biases: "attention_bias": config.json's `attention_bias` gives q/k/v and o biases (Llama);
        "qkv": q/k/v always carry a bias and o never does (Qwen2); "qkv_bias": q/k/v carry one
        unless config.json's `qkv_bias` is false, o never does (Qwen2-MoE).
      sliding_window_opt_in: config.json's `sliding_window` applies only with `use_sliding_window`
        or sliding `layer_types` (Qwen2, Qwen3); otherwise it always applies (Mistral).
      moe: a mixture of experts, one of `MOE_KINDS` (how config.json sizes and routes them);
        None: a dense model.
      hf_defaults: `(field, value)` pairs config.json may leave out, read as its transformers
        config class reads them (Gemma 3's defaults are not Llama's).
      unit_offset_norms: every RMSNorm scales by `1 + w`, in float32 before the cast (Gemma);
        False: by `w`, after the cast (Llama).
      scaled_embeddings: the embedding's rows are multiplied by `sqrt(hidden_size)` (rounded to
        the parameters' dtype, as transformers does; Gemma).
      text_config: config.json describes the language model under this key (a multimodal
        checkpoint served as its text model: Gemma 3's 4B-27B); None: at the top.
      ignored_prefixes: checkpoint tensors under these prefixes are not the model's and are
        skipped (a multimodal checkpoint's vision tower and projector).

    The forward pass follows the table as well: a layer holds the norms after attention and
    after the MLP (`attn_out_norm`, `mlp_out_norm`) when its table declares them (Gemma 3).
    """

    name: str
    hf_names: tuple[str, ...]
    params: tuple[ParamSpec, ...]
    biases: str = "attention_bias"
    sliding_window_opt_in: bool = False
    moe: str | None = None
    hf_defaults: tuple[tuple[str, object], ...] = ()
    unit_offset_norms: bool = False
    scaled_embeddings: bool = False
    text_config: str | None = None
    ignored_prefixes: tuple[str, ...] = ()

    def __post_init__(self):
        if self.biases not in BIAS_RULES:
            raise ValueError(f"Architecture {self.name}: biases={self.biases!r} must be one of {BIAS_RULES}")
        if self.moe not in (None, *MOE_KINDS):
            raise ValueError(f"Architecture {self.name}: moe={self.moe!r} must be None or one of {MOE_KINDS}")


def _discover() -> dict[str, Architecture]:
    found = {}
    for module in pkgutil.iter_modules(__path__):
        arch = importlib.import_module(f"{__name__}.{module.name}").ARCHITECTURE
        if arch.name in found:
            raise ValueError(f"two architectures named {arch.name!r}")
        found[arch.name] = arch
    return found


# `ModelConfig.architecture` -> its declaration, and config.json's class names -> the same.
ARCHITECTURES: dict[str, Architecture] = _discover()
BY_HF_NAME: dict[str, Architecture] = {hf: arch for arch in ARCHITECTURES.values() for hf in arch.hf_names}
