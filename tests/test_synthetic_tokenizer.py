"""The GPU runs' stand-in for a preset's tokenizer (benchmarks/gpu/synthetic_tokenizer.py): the
demo tokenizer extended to Llama-3.1's 128,256 ids. `bench extraction` on a model of that
vocabulary (tiny here, 8B shapes on the GPU) writes valid documents with it."""

import json

from transformers import AutoTokenizer

from benchmarks.gpu.synthetic_tokenizer import filler
from benchmarks.gpu.synthetic_tokenizer import main as write_main
from jaxpaged.cli import main
from jaxpaged.config.presets import get_preset
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR


def test_it_covers_the_presets_ids_and_bench_extraction_runs_on_it(tmp_path):
    write_main(["--model", "llama-3.1-8b", "--out", str(tmp_path / "tok")])
    preset = get_preset("llama-3.1-8b")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    demo = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    assert len(tokenizer) == preset["vocab_size"] == 128256
    text = "And the LORD spake unto Moses"
    assert tokenizer.encode(text)[1:] == demo.encode(text)[1:]  # the demo's BPE, Llama's BOS
    assert tokenizer.encode(text)[0] == tokenizer.bos_token_id == preset["bos_token_id"]
    assert tokenizer.eos_token_id == preset["eos_token_id"]
    assert tokenizer.decode([5000, 128255]) == filler(5000) + filler(128255)

    # a tiny model of Llama-3.1's vocabulary, its BOS and EOS ids, dummy weights
    model = tmp_path / "model"
    model.mkdir()
    with open(f"{DEMO_MODEL_DIR}/config.json") as f:
        config = json.load(f)
    config.update(vocab_size=128256, bos_token_id=128000, eos_token_id=128001, pad_token_id=128001)
    config.update(hidden_size=64, intermediate_size=128, num_hidden_layers=1, head_dim=32, num_attention_heads=2)
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "extraction.json"
    argv = [
        "bench",
        "extraction",
        "--model",
        str(model),
        "--load-format",
        "dummy",
        "--tokenizer",
        str(tmp_path / "tok"),
    ]
    argv += ["--num-prompts", "2", "--prefix-len", "20", "--note-len", "10,20", "--output-len", "300"]
    argv += ["--configs", "json+prefix-cache", "--max-num-seqs", "2", "--dtype", "float32", "--output-json", str(out)]
    assert main(argv) == 0
    run = json.loads(out.read_text())["runs"]["json+prefix-cache"]
    assert run["valid_fraction"] == 1.0 and run["finish_reasons"] == {"stop": 2}, run
