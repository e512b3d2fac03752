"""Rows of the collectives suite: the table and the JSON list.

The table has nccl-tests' columns (size, count, type, redop, time, algbw, busbw, #wrong), then
what quantization changes: logical bytes (= size), payload bytes, the compression ratio logical /
payload, and the inter-node bytes measured on the wire per call ("-" without the cluster launcher).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterable


@dataclasses.dataclass(frozen=True, kw_only=True)
class Row:
    op: str
    size_bytes: int
    count: int
    dtype: str
    redop: str
    time_us: float
    algbw_gbps: float
    busbw_gbps: float
    wrong: int
    logical_bytes: int
    payload_bytes: int
    wire_bytes: float | None

    @property
    def compression(self) -> float:
        return self.logical_bytes / self.payload_bytes if self.payload_bytes else 1.0

    def as_json(self) -> dict[str, object]:
        return {key: getattr(self, key) for key in JSON_KEYS}


JSON_KEYS = tuple(field.name for field in dataclasses.fields(Row) if field.name != "redop")
# (heading, Row attribute, width, format)
_COLUMNS = (
    ("op", "op", 28, "s"),
    ("size(B)", "size_bytes", 12, "d"),
    ("count", "count", 11, "d"),
    ("type", "dtype", 8, "s"),
    ("redop", "redop", 5, "s"),
    ("time(us)", "time_us", 12, ".1f"),
    ("algbw(GB/s)", "algbw_gbps", 11, ".4f"),
    ("busbw(GB/s)", "busbw_gbps", 11, ".4f"),
    ("#wrong", "wrong", 7, "d"),
    ("logical(B)", "logical_bytes", 12, "d"),
    ("payload(B)", "payload_bytes", 12, "d"),
    ("ratio", "compression", 6, ".2f"),
    ("wire(B)", "wire", 12, "s"),
)


def header() -> str:
    return "# " + "  ".join(f"{name:>{width}}" for name, _, width, _ in _COLUMNS)


def format_row(row: Row) -> str:
    wire = "-" if row.wire_bytes is None else f"{row.wire_bytes:.0f}"
    values = [wire if attr == "wire" else getattr(row, attr) for _, attr, _, _ in _COLUMNS]
    return "  " + "  ".join(f"{value:>{width}{fmt}}" for value, (_, _, width, fmt) in zip(values, _COLUMNS, strict=True))


def write_json(rows: Iterable[Row], path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump([row.as_json() for row in rows], handle, indent=1)
        handle.write("\n")
