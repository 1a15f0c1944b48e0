"""The model equals Hugging Face transformers: logits and greedy continuations, through the pool.

Each variant is a tiny random HF model saved as safetensors, converted with the converter,
loaded back, and run through the paged pool with shuffled (non-contiguous) block tables.
"""

import numpy as np
import pytest
import torch
from tiny_models import VARIANTS, save_hf_model

from jaxpaged.checkpoint.convert import convert_checkpoint
from jaxpaged.checkpoint.loader import load_model
from jaxpaged.worker.paged_generate import PagedGenerator

PROMPT_LENGTHS = (1, 7, 16, 17, 100, 300)
GREEDY_TOKENS = 64


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """||ours - theirs|| / ||theirs||; NaN anywhere makes it infinite."""
    if not np.isfinite(ours).all():
        return float("inf")
    return float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def converted(request, tmp_path_factory):
    """(variant name, HF torch model, our float32 model loaded from the converted checkpoint)."""
    root = tmp_path_factory.mktemp(request.param)
    hf_model = save_hf_model(request.param, str(root / "hf"))
    convert_checkpoint(str(root / "hf"), str(root / "converted"), dtype="float32")
    _, model = load_model(str(root / "converted"), dtype="float32")
    return request.param, hf_model, model


def hf_logits(hf_model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].numpy()


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    hf_model.generation_config.eos_token_id = None  # generate the full length, as we do
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def random_prompt(rng: np.random.Generator, length: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, size=length).tolist()


def test_prompt_logits_match_transformers(converted):
    name, hf_model, model = converted
    rng = np.random.default_rng(0)
    generator = PagedGenerator(model, block_size=16, block_shuffle_seed=1)
    for length in PROMPT_LENGTHS:
        prompt = random_prompt(rng, length, model.config.vocab_size)
        err = relative_error(generator.prompt_logits(prompt), hf_logits(hf_model, prompt))
        assert err < 1e-4, f"{name}: prompt of {length} tokens, relative error {err:.2e}"


def test_chunked_prefill_logits_match_transformers(converted):
    """Prefill in chunks that end mid-block: every chunk reads the earlier ones from the pool."""
    name, hf_model, model = converted
    prompt = random_prompt(np.random.default_rng(1), 100, model.config.vocab_size)
    generator = PagedGenerator(model, block_size=16, block_shuffle_seed=2)
    err = relative_error(generator.prompt_logits(prompt, chunk_size=23), hf_logits(hf_model, prompt))
    assert err < 1e-4, f"{name}: chunked prefill relative error {err:.2e}"


def test_greedy_continuations_match_transformers(converted):
    name, hf_model, model = converted
    rng = np.random.default_rng(2)
    prompts = [random_prompt(rng, n, model.config.vocab_size) for n in (1, 9, 16, 33)]
    generator = PagedGenerator(model, block_size=16, block_shuffle_seed=3)
    ours = generator.generate(prompts, GREEDY_TOKENS)
    for prompt, tokens in zip(prompts, ours):
        assert tokens == hf_greedy(hf_model, prompt, GREEDY_TOKENS), f"{name}: prompt of {len(prompt)} tokens"
