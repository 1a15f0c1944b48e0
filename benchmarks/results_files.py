"""Where a benchmark script's results go: its JSON report, and its markdown table beside it."""

import json
import os


def save_results(json_path: str, report: dict, table: str) -> None:
    """Writes `report` to `json_path` and `table` to the same name with `.md`."""
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    with open(os.path.splitext(json_path)[0] + ".md", "w") as f:
        f.write(table + "\n")
