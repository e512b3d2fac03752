"""The suite's output: the table and the JSON list of its rows, and what the zcomm rows buy over torch's.

The table has nccl-tests' columns, then logical bytes (= size), payload bytes, their ratio and
the inter-node bytes on the wire per call ("-" without the cluster launcher). The comparison
(``bench/PERFORMANCE.md``): each quantized row's speedup over its baseline at the same size;
wire bytes over those of a bandwidth-optimal bf16 ring (2-byte elements whatever ``-d`` is;
twice the ring for an all-reduce: reduce-scatter + all-gather); ``reduce_scatter_q4``'s time at
``stages=1`` over its time at each ``stages >= 2``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterable, Sequence

from bench.harness.bandwidth import ring_internode_bytes

from .catalog import COLLECTIVES


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


def _collective(row: Row):
    return COLLECTIVES[row.op.split(":", 1)[0]]


def speedups(rows: Sequence[Row]) -> list[str]:
    by_key = {(row.op, row.size_bytes): row for row in rows}
    lines = []
    for row in rows:
        baseline = by_key.get((_collective(row).baseline, row.size_bytes))
        if baseline is not None:
            lines.append(f"{row.op:>28} vs {baseline.op:<15} {row.size_bytes:>10} B: {baseline.time_us / row.time_us:6.2f}x")
    return lines


def wire_ratios(rows: Sequence[Row], *, num_nodes: int, local_size: int, itemsize: int) -> list[str]:
    lines = []
    for row in rows:
        if row.wire_bytes is None or num_nodes < 2:
            continue
        ring = ring_internode_bytes(row.size_bytes // itemsize * 2, num_nodes, local_size)
        ring *= 2 if _collective(row).kind == "all_reduce" else 1
        lines.append(f"{row.op:>28} {row.size_bytes:>10} B: wire {row.wire_bytes:14.0f} B = "
                     f"{row.wire_bytes / ring:5.3f}x the bf16 ring ({ring:.0f} B)")
    return lines


def pipelining(rows: Sequence[Row]) -> list[str]:
    single = {row.size_bytes: row for row in rows if row.op == "reduce_scatter_q4:stages=1"}
    lines = []
    for row in rows:
        one = single.get(row.size_bytes)
        if one is not None and row.op.startswith("reduce_scatter_q4:stages=") and row is not one:
            lines.append(f"{row.op:>28} {row.size_bytes:>10} B: {one.time_us / row.time_us:5.2f}x the speed of stages=1")
    return lines
