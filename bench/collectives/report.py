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

    @property
    def wire(self) -> str:
        return "-" if self.wire_bytes is None else f"{self.wire_bytes:.0f}"


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
    return "  " + "  ".join(f"{getattr(row, attr):>{width}{fmt}}" for _, attr, width, fmt in _COLUMNS)


def write_json(rows: Iterable[Row], path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump([{key: getattr(row, key) for key in JSON_KEYS} for row in rows], handle, indent=1)
        handle.write("\n")


def _collective(row: Row):
    return COLLECTIVES[row.op.split(":", 1)[0]]


def speedups(rows: Sequence[Row]) -> list[str]:
    by_key = {(row.op, row.size_bytes): row for row in rows}
    pairs = [(row, by_key.get((_collective(row).baseline, row.size_bytes))) for row in rows]
    return [f"{row.op:>28} vs {base.op:<15} {row.size_bytes:>10} B: {base.time_us / row.time_us:6.2f}x"
            for row, base in pairs if base is not None]


def wire_ratios(rows: Sequence[Row], *, num_nodes: int, local_size: int, itemsize: int) -> list[str]:
    lines = []
    for row in (row for row in rows if row.wire_bytes is not None and num_nodes > 1):
        ring = ring_internode_bytes(row.size_bytes // itemsize * 2, num_nodes, local_size)
        ring *= 2 if _collective(row).kind == "all_reduce" else 1
        lines.append(f"{row.op:>28} {row.size_bytes:>10} B: wire {row.wire_bytes:14.0f} B = "
                     f"{row.wire_bytes / ring:5.3f}x the bf16 ring ({ring:.0f} B)")
    return lines


def pipelining(rows: Sequence[Row]) -> list[str]:
    single = {row.size_bytes: row for row in rows if row.op == "reduce_scatter_q4:stages=1"}
    staged = [row for row in rows if row.op.startswith("reduce_scatter_q4:stages=") and row.op != "reduce_scatter_q4:stages=1"]
    return [f"{row.op:>28} {row.size_bytes:>10} B: {single[row.size_bytes].time_us / row.time_us:5.2f}x the speed of stages=1"
            for row in staged if row.size_bytes in single]
