"""What the zcomm rows buy over torch's, read off the rows of one run.

* speedup: baseline time / zcomm time at the same size (each quantized op against its
  collective's ``baseline``, every stages variant included);
* wire ratio: measured inter-node bytes per call / what a bandwidth-optimal bf16 ring sends
  across nodes for the same elements (:func:`bench.harness.bandwidth.ring_internode_bytes`,
  2-byte elements whatever ``-d`` is; twice that for an all-reduce: reduce-scatter + all-gather);
* pipelining: ``reduce_scatter_q4`` time with ``stages=1`` / with each ``stages >= 2``.
"""

from __future__ import annotations

from typing import Sequence

from bench.harness.bandwidth import ring_internode_bytes
from bench.harness.report import Row

from .catalog import COLLECTIVES


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
