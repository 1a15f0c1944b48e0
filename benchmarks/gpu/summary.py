"""What every GPU run's summary shares, rewritten after every stage: OUT/summary.json (the device,
the plan, the run's notes, every stage's record with its headline), OUT/summary.md (the device,
a table of the stages' statuses, then the run's own tables) and OUT/stages.tar.gz (the work
directory's stage files, without the compilation caches: a device call returns at most 8 files).

Each run brings a `Summary`: how a stage's record becomes its headline, and its markdown.
"""

import dataclasses
import json
import os
import tarfile
from typing import Callable


def rounded(value, digits: int = 2):
    """`value` rounded; None stays None."""
    return None if value is None else round(value, digits)


def cell(value) -> str:
    """A value in a markdown table: '-' for None."""
    return "-" if value is None else str(value)


def step_result(record: dict, *step_names: str) -> dict | None:
    """The first result of a stage's steps named `step_names` (of any step without names), or None."""
    for step in record["steps"]:
        if (not step_names or step["name"] in step_names) and step["result"]:
            return step["result"]
    return None


def steps_cell(record: dict) -> str:
    """A stage's steps and how each ended, for a summary table's cell."""
    return ", ".join(f"{s['name']} {s['status']}" for s in record["steps"])


def markdown_head(title: str, device: dict, records: list[dict], column: str, cell_of) -> list[str]:
    """The summary.md lines every run starts with: `title` and the device, REFUSED and why where the
    run was refused, then one table row per stage (status, seconds, `column` = `cell_of(record)`)."""
    lines = [
        f"# {title}: {device.get('name') or device.get('device_kind')}",
        "",
        f"jax {device.get('jax_version')}, platform {device.get('platform')}; {device.get('nvidia_smi') or ''}",
        "",
        f"| stage | status | seconds | {column} |",
        "|---|---|---|---|",
    ]
    if device.get("refused"):
        why = device.get("error") or f"JAX's platform is {device.get('platform')}, not gpu"
        lines[3:3] = [f"REFUSED: {why}; nothing was measured.", ""]
    for record in records:
        lines.append(f"| {record['stage']} | {record['status']} | {record['elapsed_s']:.0f} | {cell_of(record)} |")
    return lines


@dataclasses.dataclass(frozen=True)
class Summary:
    """One run's summary: `headline(record, records)` gives a stage's headline numbers (it may look
    at the other stages', e.g. for ratios), `markdown(device, records, plan)` the text of
    summary.md, `notes` go into summary.json (and are the markdown's to show)."""

    headline: Callable[[dict, list[dict]], dict]
    markdown: Callable[[dict, list[dict], dict], str]
    notes: tuple[str, ...] = ()

    def write(self, out_dir: str, work_dir: str, device: dict, records: list[dict], plan: dict) -> None:
        """Sets every record's headline (a partial result's error becomes its headline), then writes
        summary.json, summary.md and stages.tar.gz."""
        for record in records:
            try:
                record["headline"] = self.headline(record, records)
            except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:  # a partial result: say so, go on
                record["headline"] = {"error": f"{type(err).__name__}: {err}"}
        summary = {"device": device, "plan": plan, **({"notes": self.notes} if self.notes else {}), "stages": records}
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        with open(os.path.join(out_dir, "summary.md"), "w") as f:
            f.write(self.markdown(device, records, plan))
        with tarfile.open(os.path.join(out_dir, "stages.tar.gz"), "w:gz") as tar:
            for name in sorted(os.listdir(work_dir)):
                if not name.endswith("_xla_cache"):
                    tar.add(os.path.join(work_dir, name), arcname=os.path.join("stages", name))
