"""Phi-3 and Phi-4 (`Phi3ForCausalLM`) beyond the parity of tests/test_hf_parity.py: LongRoPE's
long factors in an engine whose contexts pass the pre-training context (transformers uses them
for such a sequence), through prefix caching and chunked prefill; 4-bit AWQ and GPTQ checkpoints
whose fused `qkv_proj` and `gate_up_proj` are one quantized linear each; and `update_weights` from
Hugging Face pairs naming the fused tensors; a compressed-tensors FP8 checkpoint of the fused
tensors (weights and per-channel scales cut in rows)."""

import ml_dtypes
import numpy as np
import pytest
import torch
from engine_fixtures import engine_greedy, hf_greedy
from flax import nnx
from fp8_checkpoint import save_fp8_checkpoint
from int4_checkpoints import save_int4_checkpoint
from tiny_models import build_hf_model, save_hf_model

from jaxpaged.checkpoint.loader import load_model
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.engine_config import EngineConfig
from jaxpaged.worker.paged_generate import PagedGenerator
from jaxpaged.worker.weight_update import WeightUpdateError

VARIANT = "phi3_longrope"
ORIGINAL = 32  # the pre-training context of the saved model: prompts of 40 and more use the long factors
PREFIX = np.random.default_rng(0).integers(3, 512, 36).tolist()
PROMPTS = [PREFIX + [5, 6, 7, 8], PREFIX + np.random.default_rng(1).integers(3, 512, 30).tolist()]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(model directory, its transformers model) with a pre-training context of `ORIGINAL`."""
    path = str(tmp_path_factory.mktemp("phi3"))
    return path, save_hf_model(VARIANT, path, original_max_position_embeddings=ORIGINAL)


def engine_args(path: str, max_model_len: int) -> EngineArgs:
    return EngineArgs(
        model=path,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        block_size=8,
        max_num_batched_tokens=16,  # prompts prefilled in chunks
        max_num_seqs=2,
    )


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return engine_greedy(engine, prompts, NEW_TOKENS)


def test_an_engine_past_the_pretraining_context_uses_the_long_factors_as_transformers_does(saved):
    path, hf = saved
    assert not EngineConfig.resolve(engine_args(path, ORIGINAL)).model.rope.use_long_factor
    engine = LLMEngine(engine_args(path, 128))
    assert engine.config.model.rope.use_long_factor
    references = [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert greedy(engine, PROMPTS) == references
    assert greedy(engine, PROMPTS[::-1]) == references[::-1]  # again, the shared prefix from the cache
    assert engine.get_stats()["prefix_cache_hits"] > 0


def test_an_engine_within_the_pretraining_context_uses_the_short_factors(saved):
    path, hf = saved
    prompt = PREFIX[:20]  # 20 + 8 new tokens stay within 32
    assert greedy(LLMEngine(engine_args(path, ORIGINAL)), [prompt]) == [hf_greedy(hf, prompt, NEW_TOKENS)]


@pytest.mark.parametrize("kind", ["awq", "gptq_act_order_asym"])
def test_4_bit_checkpoints_of_the_fused_linears_equal_the_dequantized_model(tmp_path, kind):
    hf = save_int4_checkpoint(VARIANT, kind, str(tmp_path))
    config, model = load_model(str(tmp_path), "float32")
    assert config.weight_bits == 4
    prompt = PROMPTS[1]
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(PagedGenerator(model).prompt_logits(prompt), reference, atol=2e-4)


def test_update_weights_takes_the_fused_tensors_by_their_names(saved):
    path, _ = saved
    engine = LLMEngine(engine_args(path, 128))
    other = build_hf_model(VARIANT, seed=1, original_max_position_embeddings=ORIGINAL)
    pairs = [(name, p.detach().numpy()) for name, p in other.named_parameters()]
    assert "model.layers.0.self_attn.qkv_proj.weight" in dict(pairs)
    engine.update_weights(pairs)
    assert greedy(engine, PROMPTS[:1]) == [hf_greedy(other, PROMPTS[0], NEW_TOKENS)]
    with pytest.raises(WeightUpdateError, match="q_proj.weight' is not a parameter.*qkv_proj"):
        engine.update_weights([("model.layers.0.self_attn.q_proj.weight", np.zeros((64, 64), np.float32))])


def test_a_fused_fp8_checkpoint_holds_what_quantizing_the_plain_one_at_load_makes(saved, tmp_path):
    """The same seed's weights: the fp8 bytes and scales cut out of `qkv_proj` and `gate_up_proj`
    (and their `[out, 1]` scales) are those quantizing each part at load makes."""
    path, _ = saved
    save_fp8_checkpoint(VARIANT, str(tmp_path))
    _, at_load = load_model(path, "float32", quantization="fp8", scan_layers=True)
    _, stored = load_model(str(tmp_path), "float32", scan_layers=True)
    at_load, stored = nnx.to_pure_dict(nnx.state(at_load)), nnx.to_pure_dict(nnx.state(stored))
    for group, names in (("attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj"))):
        for name in names:
            ours, theirs = stored["layers"][group], at_load["layers"][group]
            fp8 = np.dtype(ml_dtypes.float8_e4m3fn)
            assert np.asarray(ours[name + "_quant"]).dtype == fp8
            np.testing.assert_array_equal(
                np.asarray(ours[name + "_quant"]).view(np.uint8), np.asarray(theirs[name + "_quant"]).view(np.uint8)
            )
            np.testing.assert_allclose(
                np.asarray(ours[name + "_scale"]), np.asarray(theirs[name + "_scale"]), rtol=2e-7
            )
