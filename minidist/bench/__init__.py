"""Benchmarks: `python -m minidist.bench NAME`. One module per benchmark."""
from __future__ import annotations

import json


def write_records(path: str | None, records: list[dict]) -> None:
    """--json PATH: the benchmark's records as a JSON list (nothing when no path is given)."""
    if path:
        with open(path, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {path}")
