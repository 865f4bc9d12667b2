"""Where benchmark results go: one JSON file per run, under bench/results/ by default."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(report: dict, out: str | Path) -> dict:
    """Write `report` as indented JSON to `out` (parents created), say where, return it."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return report
