"""Rows of the collectives suite and their three outputs: the table, the JSON list, the plot.

The table has nccl-tests' columns (size, count, type, redop, time, algbw, busbw, #wrong) and
then what quantization changes: logical bytes (= size), payload bytes, the compression ratio
logical / payload, and the inter-node bytes measured on the wire per call ("-" when the
cluster launcher does not provide them).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Iterable, Sequence

JSON_KEYS = (
    "op",
    "size_bytes",
    "count",
    "dtype",
    "time_us",
    "algbw_gbps",
    "busbw_gbps",
    "wrong",
    "logical_bytes",
    "payload_bytes",
    "wire_bytes",
)


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


_COLUMNS = (
    ("op", 28, "s"),
    ("size(B)", 12, "d"),
    ("count", 11, "d"),
    ("type", 8, "s"),
    ("redop", 5, "s"),
    ("time(us)", 12, ".1f"),
    ("algbw(GB/s)", 11, ".4f"),
    ("busbw(GB/s)", 11, ".4f"),
    ("#wrong", 7, "d"),
    ("logical(B)", 12, "d"),
    ("payload(B)", 12, "d"),
    ("ratio", 6, ".2f"),
    ("wire(B)", 12, "s"),
)


def header() -> str:
    return "# " + "  ".join(f"{name:>{width}}" for name, width, _ in _COLUMNS)


def format_row(row: Row) -> str:
    wire = "-" if row.wire_bytes is None else f"{row.wire_bytes:.0f}"
    values = (
        row.op,
        row.size_bytes,
        row.count,
        row.dtype,
        row.redop,
        row.time_us,
        row.algbw_gbps,
        row.busbw_gbps,
        row.wrong,
        row.logical_bytes,
        row.payload_bytes,
        row.compression,
        wire,
    )
    return "  " + "  ".join(f"{value:>{width}{fmt}}" for value, (_, width, fmt) in zip(values, _COLUMNS, strict=True))


def write_json(rows: Iterable[Row], path: str) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump([row.as_json() for row in rows], handle, indent=1)
        handle.write("\n")


def write_plot(rows: Sequence[Row], path: str, title: str) -> None:
    """PNG of bus bandwidth vs size, one line per op (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op in dict.fromkeys(row.op for row in rows):
        mine = [row for row in rows if row.op == op]
        ax.plot([r.size_bytes for r in mine], [r.busbw_gbps for r in mine], marker="o", label=op)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
