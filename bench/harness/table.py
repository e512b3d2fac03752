"""The benchmarks' printed tables: markdown, one row per dict, so a run's output pastes into a report."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def markdown(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """``rows`` as a markdown table, the first row's keys as columns; floats to 2 decimals (format others first)."""
    if not rows:
        return []
    columns = list(rows[0])
    cells = [[f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c]) for c in columns] for row in rows]
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + ["| " + " | ".join(c) + " |" for c in cells]
