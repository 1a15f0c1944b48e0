"""The summary of `benchmarks/speculative_gpu.py`: each stage's headline (per batch size: TPOT,
output tokens/s, acceptance, ratios to plain decoding), summary.md's one table of them after the
stages' statuses, and the notes on what dummy weights mean for these numbers (files and
plumbing: `gpu/summary.py`)."""

from benchmarks.gpu.summary import Summary, cell, markdown_head, rounded, step_result, steps_cell

BASE = "plain"
NOTES = (
    "Dummy (random) weights: acceptance is not representative of a real model. A random model decoding greedily "
    "often falls into short cycles of repeated tokens (see the distinct-output-token fraction), which an n-gram lookup "
    "predicts perfectly; real text repeats itself less, so the n-gram rows show what lookup costs and what it can gain "
    "when its proposals are accepted, not what it gains on real prompts.",
    "The draft model (Llama-3.2-1B's shapes, 8B's vocabulary) has random weights of its own: its proposals are "
    "near-random and almost never accepted, so the draft row measures the overhead of the draft catching up and proposing "
    "k tokens in every step, not a realistic speedup.",
    "TPOT = (latency of the full generate - latency of a max_tokens=1 generate of the same prompts) / (output_len - 1); "
    "e2e TPOT = latency / output_len (`jaxpaged bench latency`'s definition). Speedup = plain's TPOT / this TPOT. "
    "Greedy; every prompt repeats a random phrase of its own (lengths in the table's heading), the same prompts for "
    "every engine; prefix caching off.",
    "'same tokens as plain': the fraction of sequences whose greedy output equals plain decoding's. Speculation is exact "
    "in exact arithmetic; in bf16 the verify step (a mixed program) and plain decode programs may round differently, so "
    "a random model's near-tied logits can diverge. Informational, not a check.",
)


def _mean(values) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def rows(record: dict, records: list[dict]) -> dict:
    """Per batch size: TPOT, throughput, acceptance, ratios to plain's (the BASE stage's) result."""
    base = next((step_result(r) for r in records if r["stage"] == BASE), None) or {}
    out = {}
    for batch, row in ((step_result(record) or {}).get("batches") or {}).items():
        plain = (base.get("batches") or {}).get(batch) or {}
        spec = row.get("spec") or {}
        same = None
        if record["stage"] != BASE and plain.get("token_ids") and row.get("token_ids"):
            pairs = list(zip(plain["token_ids"], row["token_ids"]))
            same = sum(a == b for a, b in pairs) / len(pairs)
        out[f"batch {batch}"] = {
            "tpot_ms": rounded(row["tpot_ms"]),
            "e2e_tpot_ms": rounded(row["e2e_tpot_ms"]),
            "output_tok_s": rounded(row["output_tok_s"], 1),
            "speedup_vs_plain": rounded(plain["tpot_ms"] / row["tpot_ms"], 3)
            if plain.get("tpot_ms") and row["tpot_ms"]
            else None,
            "throughput_vs_plain": rounded(row["output_tok_s"] / plain["output_tok_s"], 3)
            if plain.get("output_tok_s")
            else None,
            "acceptance": rounded(spec.get("acceptance_rate"), 3),
            "accepted_per_draft": rounded(spec.get("accepted_per_draft")),
            "same_tokens_as_plain": rounded(same, 3),
            "distinct_output_tokens": rounded(_mean(row.get("distinct_output_token_frac") or []), 3),
        }
    return out


COLUMNS = (
    ("tpot_ms", "TPOT ms"),
    ("e2e_tpot_ms", "e2e TPOT ms"),
    ("output_tok_s", "output tok/s"),
    ("speedup_vs_plain", "speedup vs plain (TPOT)"),
    ("throughput_vs_plain", "tok/s vs plain"),
    ("acceptance", "acceptance"),
    ("accepted_per_draft", "accepted per proposal"),
    ("same_tokens_as_plain", "same tokens as plain"),
    ("distinct_output_tokens", "distinct output tokens"),
)


def markdown(device: dict, records: list[dict], plan: dict) -> str:
    lines = markdown_head("Speculative decoding GPU run", device, records, "steps", steps_cell)
    table = []
    for record in records:
        headline = record.get("headline") or {}
        if "error" in headline:
            lines += ["", f"{record['stage']}: headline error {headline['error']}"]
            continue
        for batch, row in headline.items():
            table.append(
                f"| {record['stage']} | {batch.split()[-1]} | " + " | ".join(cell(row[k]) for k, _ in COLUMNS) + " |"
            )
    if table:
        lines += [
            "",
            f"## {plan.get('model')} (dummy {plan.get('dtype', 'bf16')} weights), greedy, {plan.get('workload', '')}",
            "",
            "| config | batch | " + " | ".join(name for _, name in COLUMNS) + " |",
            "|---|---|" + "---|" * len(COLUMNS),
            *table,
        ]
    if records:
        lines += ["", "Notes:", "", *(f"- {note}" for note in NOTES)]
    return "\n".join(lines) + "\n"


SUMMARY = Summary(rows, markdown, NOTES)
