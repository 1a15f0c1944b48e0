"""Clinical notes at their real lengths (issue 48): a tiny Llama-3.1-style model with llama3 RoPE
scaling (factor 8 over 4,096 positions: a context of 32K), through the engine's chunked prefill
(steps of 2,048 tokens), equals transformers greedy token for token on 8K notes behind a shared
900-token prefix (the second note's prefix from the prefix cache) and on a 32K prompt.

On the CPU the engine's reference attention reads every block a sequence may hold
(`max_model_len`), so these take minutes: the slow tier."""

import numpy as np
import pytest
import torch
import transformers
from tiny_models import BASE, widen_weights

from jaxpaged.entrypoints.llm import LLM
from jaxpaged.sampling_params import SamplingParams

CONTEXT = 32768
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=4096
)
TOKENS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the transformers model, an engine over its checkpoint with a 32K context)."""
    config = transformers.LlamaConfig(
        **{**BASE, "num_key_value_heads": 2, "max_position_embeddings": CONTEXT + 64, "rope_scaling": LLAMA3_ROPE}
    )
    torch.manual_seed(0)
    hf = widen_weights(transformers.LlamaForCausalLM(config).eval())
    path = tmp_path_factory.mktemp("llama3-32k")
    hf.save_pretrained(path, safe_serialization=True)
    llm = LLM(
        model=str(path),
        dtype="float32",
        max_model_len=CONTEXT + 16,
        max_num_seqs=2,
        max_num_batched_tokens=2048,
        skip_tokenizer_init=True,
    )
    return hf, llm


def greedy(llm: LLM, prompt: list[int]) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids


def hf_greedy(hf, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False)[0, len(prompt) :].tolist()


def test_8k_notes_behind_a_shared_prefix_equal_transformers(models):
    hf, llm = models
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 512, 900).tolist()
    notes = [prefix + rng.integers(3, 512, n).tolist() for n in (7300, 7700)]
    hits = llm.get_stats()["prefix_cache_hits"]
    for note in notes:
        assert greedy(llm, note) == hf_greedy(hf, note), len(note)
    assert llm.get_stats()["prefix_cache_hits"] - hits >= 896  # the second note read the prefix's blocks


def test_a_32k_prompt_equals_transformers(models):
    hf, llm = models
    prompt = np.random.default_rng(1).integers(3, 512, CONTEXT - TOKENS).tolist()
    assert greedy(llm, prompt) == hf_greedy(hf, prompt)
