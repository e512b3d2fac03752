"""The benchmarks' printed tables: markdown, so a run's output pastes into a report."""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> list[str]:
    """A markdown table, cells as ``str`` gives them; ``align`` holds one letter per column, ``r`` for right-aligned."""
    rule = "".join("---:|" if a == "r" else "---|" for a in align.ljust(len(header), "l"))
    return [f"| {' | '.join(header)} |", f"|{rule}", *(f"| {' | '.join(map(str, row))} |" for row in rows)]


def markdown(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """``rows`` as a markdown table, the first row's keys as columns; floats to 2 decimals (format others first)."""
    columns = list(rows[0]) if rows else []
    cells = [[f"{row[c]:.2f}" if isinstance(row[c], float) else row[c] for c in columns] for row in rows]
    return table(columns, cells) if rows else []
