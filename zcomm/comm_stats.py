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
_STATS: dict[str, OpStats] = {}


def comm_stats() -> dict[str, OpStats]:
    """A snapshot: op name -> :class:`OpStats` of what this process sent."""
    with _LOCK:
        return dict(_STATS)


def reset_comm_stats() -> None:
    """Forget all counts of this process."""
    with _LOCK:
        _STATS.clear()


def record(op: str, intra_bytes: int, inter_bytes: int) -> None:
    """Add one call of ``op`` that sent the given bytes (for zcomm's collectives, from their byte model)."""
    assert intra_bytes >= 0 and inter_bytes >= 0
    with _LOCK:
        old = _STATS.get(op, OpStats())
        _STATS[op] = OpStats(old.calls + 1, old.intra_bytes + intra_bytes, old.inter_bytes + inter_bytes)
