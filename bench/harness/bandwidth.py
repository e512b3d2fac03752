"""nccl-tests' algbw and busbw, and the inter-node bytes of a bandwidth-optimal ring (``bench/PERFORMANCE.md``)."""

from __future__ import annotations

BUS_FACTOR_KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


def _check_ranks(nranks: int) -> None:
    if isinstance(nranks, bool) or not isinstance(nranks, int):
        raise TypeError(f"nranks must be an int, got {nranks!r}")
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")


def bus_factor(kind: str, nranks: int) -> float:
    _check_ranks(nranks)
    if kind not in BUS_FACTOR_KINDS:
        raise ValueError(f"kind must be one of {BUS_FACTOR_KINDS}, got {kind!r}")
    ring = (nranks - 1) / nranks
    return 2 * ring if kind == "all_reduce" else ring


def algbw_gbps(size_bytes: int, seconds: float) -> float:
    """GB/s of 10**9 bytes, as nccl-tests prints."""
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return size_bytes / seconds / 1e9


def busbw_gbps(kind: str, size_bytes: int, seconds: float, nranks: int) -> float:
    return algbw_gbps(size_bytes, seconds) * bus_factor(kind, nranks)


def ring_internode_bytes(size_bytes: int, num_nodes: int, local_size: int) -> float:
    """Bytes a node-major ring all-gather (``S`` = output) or reduce-scatter (``S`` = input) sends across nodes."""
    _check_ranks(num_nodes)
    _check_ranks(local_size)
    n = num_nodes * local_size
    return 0.0 if num_nodes == 1 else num_nodes * (n - 1) / n * size_bytes
