"""bfloat16 runs produce finite logits close to float32 ones."""

import numpy as np
from tiny_models import save_hf_model

from jaxpaged.checkpoint.loader import load_model
from jaxpaged.worker.paged_generate import PagedGenerator


def test_bfloat16_logits_close_to_float32(tmp_path):
    save_hf_model("llama_gqa4", str(tmp_path))
    prompt = np.random.default_rng(0).integers(3, 512, size=40).tolist()
    logits = {}
    for dtype in ("float32", "bfloat16"):
        _, model = load_model(str(tmp_path), dtype=dtype)
        assert model.embed[...].dtype.name == dtype
        logits[dtype] = PagedGenerator(model, block_size=16, block_shuffle_seed=0).prompt_logits(prompt)
    assert np.isfinite(logits["bfloat16"]).all()
    err = np.linalg.norm(logits["bfloat16"] - logits["float32"]) / np.linalg.norm(logits["float32"])
    assert err < 3e-2, f"bfloat16 vs float32 relative error {err:.2e}"
