"""Shared pieces of the engine tests: a tiny model directory with a tokenizer, HF greedy references."""

import torch
from tiny_models import save_hf_model
from tiny_tokenizer import save_tokenizer

VOCAB = 512


def make_model_dir(path: str, variant: str = "llama_gqa4"):
    """Saves a tiny HF model and a matching tokenizer into `path`; returns the torch model."""
    model = save_hf_model(variant, path)
    save_tokenizer(path, VOCAB)
    return model


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, never stopping early."""
    hf_model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt) :].tolist()
