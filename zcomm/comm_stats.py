"""Per-op counts of the bytes this process sent, split into intra- and inter-node traffic.

Byte model (what each collective call adds for the calling rank, from its own arguments
and topology; quantized payloads count in full: values, padding and scales):

* all-to-all (qgZ's hops): every row sent to *another* rank of the hop's group, counted
  as intra-node if that rank is on this rank's node, else inter-node. For
  ``reduce_scatter_q4`` on ``N`` nodes of ``L`` ranks with ``k`` stages and per-stage part
  ``q = ceil((input.numel() / W) / k)``: intra ``= k * (L-1) * payload(N*q, INT4)``,
  inter ``= k * (N-1) * payload(q, INT4)`` (with ``L = 1`` the rows go straight across
  nodes: inter ``= k * (N-1) * payload(q, INT4)``, intra 0).
* hierarchical all-gather (``all_gather_q8``): a ring all-gather of this rank's INT8
  payload (``P`` bytes) among the ``N`` ranks with its local rank, then a ring all-gather
  of the ``N`` gathered payloads among the node's ``L`` ranks: inter ``= (N-1) * P``,
  intra ``= (L-1) * N * P``.
* flat all-gather / reduce-scatter (the plain pass-throughs): the bandwidth-optimal ring
  in group-rank order, where each rank sends ``W - 1`` chunks to rank ``(r + 1) % W``:
  ``(W - 1) * chunk`` bytes, intra-node if that neighbour shares the node, else
  inter-node. ``chunk`` is the input bytes for ``all_gather_into_tensor`` and the output
  bytes for ``reduce_scatter_tensor``.

Each collective computes its figures in its own module; this one only adds them up.
This is the model the ZeRO++ paper reasons with, not a packet capture: gloo's actual
algorithms differ (its reduce-scatter is an all-reduce). Counts are per process, updated
under a lock (qgZ runs on worker threads), and recorded when the call is issued.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

__all__ = ["OpStats", "comm_stats", "reset_comm_stats"]


@dataclass(frozen=True)
class OpStats:
    """Totals for one op name since the last :func:`reset_comm_stats`."""

    calls: int = 0
    intra_bytes: int = 0
    inter_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.intra_bytes + self.inter_bytes


_LOCK = threading.Lock()


class StatsRow:
    """The running totals of one op name, which a collective's plan holds and adds each call to.

    [Note: held stats rows] A plan (or prepared call) resolves its op's row once and adds to it
    per call, under the lock, with no lookup and no object built. Rows are never removed:
    :func:`reset_comm_stats` zeroes every row in place, so a row a plan holds keeps counting
    into the table that :func:`comm_stats` reads, and an op with no call since the reset is
    absent from the snapshot, as before the first call.
    """

    __slots__ = ("calls", "intra_bytes", "inter_bytes")

    def __init__(self) -> None:
        self.calls = self.intra_bytes = self.inter_bytes = 0

    def add(self, intra_bytes: int, inter_bytes: int) -> None:
        """One call that sent these bytes (non-negative: the plan computed them)."""
        with _LOCK:
            self.calls += 1
            self.intra_bytes += intra_bytes
            self.inter_bytes += inter_bytes


_ROWS: dict[str, StatsRow] = {}


def stats_row(op: str) -> StatsRow:
    """The row of ``op``, made on first use ([Note: held stats rows])."""
    row = _ROWS.get(op)
    if row is None:
        with _LOCK:
            row = _ROWS.setdefault(op, StatsRow())
    return row


def comm_stats() -> dict[str, OpStats]:
    """A snapshot: op name -> :class:`OpStats` of what this process sent."""
    with _LOCK:
        return {op: OpStats(row.calls, row.intra_bytes, row.inter_bytes) for op, row in _ROWS.items() if row.calls}


def reset_comm_stats() -> None:
    """Forget all counts of this process."""
    with _LOCK:
        for row in _ROWS.values():
            row.calls = row.intra_bytes = row.inter_bytes = 0


def record(op: str, intra_bytes: int, inter_bytes: int) -> None:
    """Add one call of ``op`` that sent the given bytes (for zcomm's collectives, from their byte model)."""
    assert intra_bytes >= 0 and inter_bytes >= 0
    stats_row(op).add(intra_bytes, inter_bytes)
