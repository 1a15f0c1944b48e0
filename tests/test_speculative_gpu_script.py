"""`benchmarks/speculative_gpu.py` runs end to end on the CPU with `--smoke` (the demo model with
dummy weights, tiny shapes and batch sizes 1 and 2), and its pieces do what the GPU run needs.

The real run needs a GPU (`bash benchmarks/run_gpu.sh speculative "$OUT"`); these keep it from
rotting: every stage (plain, n-gram k=2 and k=4, a draft model) an engine in its own process,
each step's JSON parsed into the summary, the headlines (TPOT, tokens/s, acceptance, ratios to
plain), the markdown table and notes, the tarball; the prompts, the counters' sums and the
Llama-3.2-1B-shaped draft config the GPU plan writes.
"""

import json
import math
import os
import tarfile

from gpu_script_smoke import run_script, smoke_run_fixture

from benchmarks import speculative_gpu
from benchmarks.gpu.spec_latency import repetitive_prompts, spec_delta, sum_deltas

STAGES = ("plain", "ngram_k2", "ngram_k4", "draft")
HEADLINE_KEYS = {
    "tpot_ms",
    "e2e_tpot_ms",
    "output_tok_s",
    "speedup_vs_plain",
    "throughput_vs_plain",
    "acceptance",
    "accepted_per_draft",
    "same_tokens_as_plain",
    "distinct_output_tokens",
}


smoke_run = smoke_run_fixture("speculative_gpu", timeout=300)


def test_smoke_runs_every_stage(smoke_run):
    out, work, summary = smoke_run
    assert summary["device"]["platform"] == "cpu" and summary["device"]["jax_version"]
    assert summary["plan"]["smoke"] is True and list(summary["plan"]["speculative_configs"]) == list(STAGES)
    assert any("Dummy" in note and "not representative" in note for note in summary["notes"])
    records = {r["stage"]: r for r in summary["stages"]}
    assert list(records) == list(STAGES)
    assert {name: r["status"] for name, r in records.items()} == {name: "ok" for name in STAGES}
    for name, record in records.items():
        assert [s["name"] for s in record["steps"]] == ["latency"], name
        step = record["steps"][0]
        assert step["status"] == "ok" and step["returncode"] == 0 and step["result"], name
    assert sorted(os.listdir(out)) == ["console.txt", "stages.tar.gz", "summary.json", "summary.md"]
    for name in STAGES:  # each stage's own JSON is its summary record
        assert json.loads((work / f"{name}.json").read_text())["status"] == "ok"
    with tarfile.open(out / "stages.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"stages/{name}.{ext}" for name in STAGES for ext in ("json", "txt")} <= names
    assert {f"stages/{name}.result.json" for name in STAGES} | {"stages/draft_model/config.json"} <= names
    assert not any("xla_cache" in name for name in names)


def test_smoke_results_and_headlines(smoke_run):
    out, work, summary = smoke_run
    records = {r["stage"]: r for r in summary["stages"]}
    for name, record in records.items():
        result = record["steps"][0]["result"]
        assert result["label"] == name and result["input_len"] == 16 and result["output_len"] == 8
        assert list(result["batches"]) == ["1", "2"]
        for batch, row in result["batches"].items():
            # TPOT is a difference of two timings: on a busy CPU with 8 tokens it may come out negative
            assert math.isfinite(row["tpot_ms"]) and row["output_tok_s"] > 0 and row["avg_prefill_s"] > 0, (name, batch)
            assert len(row["token_ids"]) == int(batch) and all(len(t) == 8 for t in row["token_ids"])
            assert ("spec" in row) == (name != "plain"), (name, batch)
        spec = result["speculative_config"]
        if name == "plain":
            assert spec is None
        else:
            stats = result["batches"]["1"]["spec"]
            assert stats["draft_tokens"] > 0 and 0 <= stats["accepted_tokens"] <= stats["draft_tokens"]
            assert stats["acceptance_rate"] == stats["accepted_tokens"] / stats["draft_tokens"]
            k = spec["num_speculative_tokens"]
            assert k == (2 if name == "ngram_k2" else 4) and len(stats["accepted_per_position"]) == k
            assert sum(stats["accepted_per_position"]) == stats["accepted_tokens"]
        assert (spec or {}).get("method") == {"ngram_k2": "ngram", "ngram_k4": "ngram", "draft": "draft_model"}.get(
            name
        )
        headline = record["headline"]
        assert list(headline) == ["batch 1", "batch 2"] and all(set(row) == HEADLINE_KEYS for row in headline.values())
        for row in headline.values():
            assert math.isfinite(row["tpot_ms"]) and row["throughput_vs_plain"] > 0
            assert row["speedup_vs_plain"] is None or math.isfinite(row["speedup_vs_plain"])
            assert (row["acceptance"] is None) == (name == "plain")
            assert (row["same_tokens_as_plain"] is None) == (name == "plain")
    assert records["plain"]["headline"]["batch 1"]["speedup_vs_plain"] == 1.0
    # the draft's directory holds a config.json of the demo's vocabulary and fewer layers
    draft = json.loads((work / "draft_model" / "config.json").read_text())
    assert draft["vocab_size"] == 4096 and draft["num_hidden_layers"] == 2
    assert records["draft"]["steps"][0]["result"]["speculative_config"]["model"] == str(work / "draft_model")
    markdown = (out / "summary.md").read_text()
    assert all(f"| {name} | ok |" in markdown for name in STAGES)
    assert all(f"| {name} | {batch} |" in markdown for name in STAGES for batch in (1, 2))
    assert "Notes:" in markdown and "near-random" in markdown


def test_refuses_without_a_gpu(tmp_path):
    proc = run_script(
        "speculative_gpu", "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work"), timeout=120
    )
    assert proc.returncode == 2 and "REFUSED" in proc.stdout
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["device"]["refused"] is True


def test_gpu_plan_draft_is_llama_32_1b_with_8b_vocabulary(tmp_path):
    from jaxpaged.config.hf_config import model_config_from_hf
    from jaxpaged.config.presets import get_preset

    plan = speculative_gpu.gpu_plan({})
    directory = speculative_gpu.write_draft_config(plan, str(tmp_path / "draft"))
    config = model_config_from_hf(json.loads((tmp_path / "draft" / "config.json").read_text()))
    target = model_config_from_hf(get_preset("llama-3.1-8b"))
    assert directory == str(tmp_path / "draft") and config.vocab_size == target.vocab_size == 128256
    assert (
        config.hidden_size,
        config.num_layers,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.intermediate_size,
        config.tie_word_embeddings,
    ) == (2048, 16, 32, 8, 64, 8192, True)
    assert config.rope.rope_type == "llama3" and config.rope.factor == 32.0
    assert sum(plan.budgets_s.values()) + 20 <= 570  # with the device probe, inside 9.5 minutes


def test_prompts_and_counters():
    prompts = repetitive_prompts(100, 3, 10, 4, "seed")
    assert len(prompts) == 3 and all(len(p["prompt_token_ids"]) == 10 for p in prompts)
    ids = prompts[0]["prompt_token_ids"]
    assert ids[:4] == ids[4:8] == ids[8:] + ids[6:8] and all(1 <= t < 100 for t in ids)
    assert prompts == repetitive_prompts(100, 3, 10, 4, "seed") and prompts != repetitive_prompts(100, 3, 10, 4, "x")
    names = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    before = {**dict(zip(names, (1, 4, 2))), "spec_decode_num_accepted_tokens_per_pos": [1, 1, 0, 0]}
    after = {**dict(zip(names, (3, 12, 5))), "spec_decode_num_accepted_tokens_per_pos": [3, 2, 0, 0]}
    delta = spec_delta(before, after)
    assert spec_delta({}, {}) == {}
    total = sum_deltas([delta, delta])
    assert total == {
        "drafts": 4,
        "draft_tokens": 16,
        "accepted_tokens": 6,
        "acceptance_rate": 6 / 16,
        "accepted_per_draft": 1.5,
        "accepted_per_position": [4, 2, 0, 0],
    }
