"""Bandwidth formulas of nccl-tests, and the inter-node bytes of a bandwidth-optimal ring.

nccl-tests reports two bandwidths for a collective that moves ``S`` bytes in ``t`` seconds
on ``n`` ranks (see ``bench/PERFORMANCE.md``):

* ``algbw = S / t``, where ``S`` is the total output of an all-gather, the total input of a
  reduce-scatter and the per-rank buffer of an all-to-all;
* ``busbw = algbw * factor``: ``(n - 1) / n`` for all-gather, reduce-scatter and all-to-all,
  ``2 (n - 1) / n`` for all-reduce. It is the bandwidth each link must sustain in a ring,
  so it is comparable across rank counts and with the hardware's peak.

The ring reference for wire bytes: a ring over all ``n = N * L`` ranks in node-major order
moves ``(n - 1) / n * S`` bytes over every link, and ``N`` of its links cross a node boundary
(none when ``N = 1``), so ``N * (n - 1) / n * S`` bytes leave the nodes in total.
"""

from __future__ import annotations

BUS_FACTOR_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


def _check_ranks(nranks: int) -> None:
    if isinstance(nranks, bool) or not isinstance(nranks, int):
        raise TypeError(f"nranks must be an int, got {nranks!r}")
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")


def bus_factor(kind: str, nranks: int) -> float:
    """nccl-tests' busbw / algbw ratio for a collective ``kind`` on ``nranks`` ranks."""
    _check_ranks(nranks)
    if kind not in BUS_FACTOR_KINDS:
        raise ValueError(f"kind must be one of {BUS_FACTOR_KINDS}, got {kind!r}")
    ring = (nranks - 1) / nranks
    return 2 * ring if kind == "all_reduce" else ring


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10**9 bytes per second, as nccl-tests prints)."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return size_bytes / seconds / 1e9


def busbw_gbps(kind: str, size_bytes: int, seconds: float, nranks: int) -> float:
    """Bus bandwidth in GB/s: ``algbw * bus_factor(kind, nranks)``."""
    return algbw_gbps(size_bytes, seconds) * bus_factor(kind, nranks)


def ring_internode_bytes(size_bytes: int, num_nodes: int, local_size: int) -> float:
    """Bytes that a node-major ring over ``num_nodes * local_size`` ranks sends across nodes.

    Holds for a ring all-gather (``size_bytes`` = total output) and a ring reduce-scatter
    (``size_bytes`` = total input) alike: the sum over the nodes of what each sends out.
    """
    _check_ranks(num_nodes)
    _check_ranks(local_size)
    if num_nodes == 1:
        return 0.0
    n = num_nodes * local_size
    return num_nodes * (n - 1) / n * size_bytes
