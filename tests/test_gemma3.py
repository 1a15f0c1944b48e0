"""Gemma 3 (`Gemma3ForCausalLM`) beyond the parity of tests/test_hf_parity.py: an engine whose
prompts run far past the sliding window, through prefix caching, chunked prefill and fused
decode steps; the Pallas kernels (interpret mode) with per-layer windows; the layers stacked for
a scan; bfloat16; pipeline parallelism refused by name; and a multimodal checkpoint
(`Gemma3ForConditionalGeneration`) served as its language model."""

import numpy as np
import pytest
import torch
import transformers
from engine_fixtures import engine_greedy, hf_greedy
from tiny_models import VARIANTS, save_hf_model, widen_weights

from jaxpaged.checkpoint.loader import load_model
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.worker.paged_generate import PagedGenerator

VARIANT = "gemma3"  # window 7: two sliding layers, then a full one
PREFIX = np.random.default_rng(0).integers(3, 512, 36).tolist()
PROMPTS = [PREFIX + [5, 6, 7, 8], PREFIX + np.random.default_rng(1).integers(3, 512, 30).tolist()]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model directory, its transformers model)."""
    path = str(tmp_path_factory.mktemp("gemma3"))
    return path, save_hf_model(VARIANT, path)


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return engine_greedy(engine, prompts, NEW_TOKENS)


def engine_args(path: str, **kwargs) -> EngineArgs:
    options = dict(
        model=path,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        block_size=8,
        max_num_batched_tokens=16,  # prompts prefilled in chunks of 16 > the window of 7
        max_num_seqs=2,
        num_scheduler_steps=4,
    )
    return EngineArgs(**{**options, **kwargs})


def test_an_engine_past_the_window_gives_transformers_tokens_from_the_prefix_cache(saved):
    path, hf = saved
    engine = LLMEngine(engine_args(path))
    references = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert greedy(engine, PROMPTS) == references
    assert greedy(engine, PROMPTS[::-1]) == references[::-1]  # again, the shared prefix from the cache
    assert engine.get_stats()["prefix_cache_hits"] > 0


def test_the_kernels_with_per_layer_windows_give_transformers_tokens(tmp_path):
    """head_dim 64 (the kernels'): the ragged kernel for chunked prefills, the decode kernel in
    fused decode steps, each layer's window traced."""
    hf = save_hf_model(VARIANT, str(tmp_path), hidden_size=128, head_dim=64)
    engine = LLMEngine(engine_args(str(tmp_path), attention_backend="pallas"))
    assert greedy(engine, PROMPTS) == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def test_stacked_layers_and_bfloat16_equal_transformers(saved):
    """A scan over the stacked layers slices each layer's own window and frequencies; in
    bfloat16 the logits stay within bfloat16's rounding of transformers' bfloat16 model."""
    path, hf = saved
    prompt = PROMPTS[1]
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].numpy()
        reference_bf16 = hf.to(torch.bfloat16)(torch.tensor([prompt])).logits[0].float().numpy()
    hf.to(torch.float32)
    _, stacked = load_model(path, "float32", scan_layers=True)
    np.testing.assert_allclose(PagedGenerator(stacked).prompt_logits(prompt), reference, atol=2e-4)
    _, bf16 = load_model(path, "bfloat16")
    ours = np.asarray(PagedGenerator(bf16).prompt_logits(prompt), np.float32)
    assert np.linalg.norm(ours - reference_bf16) / np.linalg.norm(reference_bf16) < 3e-2


def test_pipeline_parallelism_is_refused_by_name(saved):
    path, _ = saved
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 with a gemma3 model whose layers differ"):
        LLMEngine(engine_args(path, pipeline_parallel_size=2))


def test_a_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """gemma-3-4b's layout in small: config.json's text_config, the language
    model's tensors under `language_model.`, a vision tower and projector that are skipped;
    greedy text continuations equal transformers' Gemma3ForConditionalGeneration's."""
    text = {k: v for k, v in VARIANTS[VARIANT][2].items() if k != "rope_parameters"}
    text |= dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, rope_theta=1e6)
    text |= dict(rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision | dict(patch_size=14), mm_tokens_per_image=4
    )
    torch.manual_seed(0)
    hf = widen_weights(transformers.Gemma3ForConditionalGeneration(config).eval())
    hf.save_pretrained(str(tmp_path))
    engine = LLMEngine(engine_args(str(tmp_path)))
    assert engine.config.model.architecture == "gemma3_vlm" and engine.config.model.local_rope.theta == 1e4
    assert greedy(engine, PROMPTS) == [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
