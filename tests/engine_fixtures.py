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


def engine_greedy(engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation of `new_tokens` through `engine.step()` (added at once,
    never stopping early), in the prompts' order."""
    from jaxpaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((int(o.request_id), o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return [list(done[i]) for i in range(len(prompts))]
