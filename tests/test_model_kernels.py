"""The model on the Pallas kernels (interpret mode on CPU) decodes exactly like on the references."""

import numpy as np
from engine_fixtures import hf_greedy
from tiny_models import save_hf_model

from jaxpaged.checkpoint.loader import load_model
from jaxpaged.worker.paged_generate import PagedGenerator


def test_kernels_and_references_give_the_same_greedy_tokens(tmp_path):
    hf_model = save_hf_model("llama_hd64", str(tmp_path))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, size=n).tolist() for n in (21, 5)]
    tokens = {}
    for backend in ("reference", "pallas"):
        _, model = load_model(str(tmp_path), dtype="float32", attention=backend)
        tokens[backend] = PagedGenerator(model, block_size=16, block_shuffle_seed=4).generate(prompts, 8)
    assert tokens["pallas"] == tokens["reference"]
    assert tokens["reference"] == [hf_greedy(hf_model, p, 8) for p in prompts]


def test_engine_on_kernels_matches_transformers(tmp_path):
    """Through the engine: ragged kernel for prefills, decode kernel inside fused decode steps."""
    from tiny_tokenizer import save_tokenizer

    from jaxpaged.entrypoints.llm import LLM
    from jaxpaged.sampling_params import SamplingParams

    hf_model = save_hf_model("llama_hd64", str(tmp_path))
    save_tokenizer(str(tmp_path), 512)
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        attention_backend="pallas",
        num_scheduler_steps=4,
    )
    prompts = [[1, 5, 9, 13, 17, 21, 25], [1, 7]]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_model, p, 9) for p in prompts]
