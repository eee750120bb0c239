"""What every benchmark shares: the summary of a sample, and printing/writing its JSON."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any


def summary(values: list[float], unit: str) -> dict[str, float]:
    """count, median, p99 (nearest rank), min and max of `values`, keys suffixed by `unit`."""
    ordered = sorted(values)
    return {
        "count": len(ordered),
        f"median_{unit}": round(statistics.median(ordered), 6),
        f"p99_{unit}": round(ordered[math.ceil(0.99 * len(ordered)) - 1], 6),
        f"min_{unit}": round(ordered[0], 6),
        f"max_{unit}": round(ordered[-1], 6),
    }


def report(result: dict[str, Any], out: Path | None) -> None:
    """Print the result as JSON, and write it to `out` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
