"""Bytes on a node's uplink, from the interface counters of the current network namespace.

Under ``bench.simcluster`` every rank runs in its node's namespace, where ``ZCOMM_WIRE_IFACE``
is the only link to the other nodes: every rank of a node sees the same counters, and traffic
between ranks of one node goes over loopback, uncounted.
"""

from __future__ import annotations

import os

WIRE_IFACE_ENV = "ZCOMM_WIRE_IFACE"
PROC_NET_DEV = "/proc/net/dev"


def parse_net_dev(text: str, iface: str) -> tuple[int, int]:
    """``(tx_bytes, rx_bytes)`` of ``iface`` in the text of ``/proc/net/dev``."""
    for line in text.splitlines():
        name, sep, fields = line.partition(":")
        if sep and name.strip() == iface:
            values = fields.split()
            # Columns: 8 receive counters (bytes first), then 8 transmit counters (bytes first).
            return int(values[8]), int(values[0])
    raise ValueError(f"interface {iface!r} is not in {PROC_NET_DEV}")


def read_wire_bytes() -> tuple[int, int] | None:
    """``(tx_bytes, rx_bytes)`` of the node's uplink, or None when not under the cluster launcher."""
    iface = os.environ.get(WIRE_IFACE_ENV)
    if not iface:
        return None
    with open(PROC_NET_DEV, encoding="ascii") as handle:
        return parse_net_dev(handle.read(), iface)
