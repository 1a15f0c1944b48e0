"""The model on the Pallas kernels (interpret mode on CPU) decodes exactly like on the references."""

import numpy as np
from engine_fixtures import hf_greedy
from tiny_models import save_hf_model

from jaxpaged.paged_generate import PagedGenerator
from jaxpaged.weights import load_model


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
