"""The simulated network: one namespace per node, joined by veth links to a bridge namespace::

    zcsim-<pid>-n<i>  (node i)                      zcsim-<pid>-br
      lo (up: ranks of the node talk here)           br0 (bridge)
      zc-up 10.213.0.<i+1>/24  <-- veth pair -->     p<i> (port of br0)

``<pid>`` is the launcher's, so concurrent launches never share a name. The root namespace is
never touched: each veth pair is created in the node's namespace with its peer moved straight
into the bridge's. A token bucket (``tbf``) on both ends (zc-up and p<i>) limits each node's
link in both directions. IPv6 address generation is off, so no router solicitations add to the
counters. Deleting a namespace deletes its end of each veth pair, and so the pair.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess

from .config import ClusterConfig

UPLINK = "zc-up"
SUBNET = "10.213.0"
PREFIX = "zcsim"
_OURS = re.compile(rf"^{PREFIX}-(\d+)-")


class NetworkError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message carries its stderr."""


def _run(*argv: str) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode:
        raise NetworkError(f"{' '.join(argv)} failed: {result.stderr.strip() or result.returncode}")
    return result.stdout


def _delete(name: str) -> bool:
    return subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False).returncode == 0


def remove_stale() -> list[str]:
    """Delete namespaces left by launches whose process is gone; returns their names."""
    names = [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]  # "name (id: k)"
    stale = [name for name in names if (m := _OURS.match(name)) and not os.path.exists(f"/proc/{m.group(1)}")]
    for name in stale:
        _delete(name)
    return stale


@dataclasses.dataclass
class SimNetwork:
    """Create with :meth:`build`, always :meth:`destroy` (also after a failed build)."""

    config: ClusterConfig
    prefix: str = dataclasses.field(default_factory=lambda: f"{PREFIX}-{os.getpid()}")
    created: list[str] = dataclasses.field(default_factory=list)

    def node_ns(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @staticmethod
    def node_addr(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def _add_ns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.created.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        rate_bps = self.config.rate_bps
        if rate_bps is not None:
            # tbf needs a bucket of at least rate / HZ (HZ can be as low as 100) plus one GSO packet.
            burst = str(max(rate_bps // 8 // 100, 64 * 1024))
            _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{rate_bps}bit",
                 "burst", burst, "latency", "100ms")

    def build(self) -> None:
        bridge = f"{self.prefix}-br"
        self._add_ns(bridge)
        _run("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", bridge, "link", "set", "br0", "addrgenmode", "none", "up")
        for node in range(self.config.num_nodes):
            ns, port = self.node_ns(node), f"p{node}"
            self._add_ns(ns)
            _run("ip", "-n", ns, "link", "add", UPLINK, "type", "veth", "peer", "name", port, "netns", bridge)
            _run("ip", "-n", bridge, "link", "set", port, "master", "br0", "addrgenmode", "none", "up")
            _run("ip", "-n", ns, "link", "set", UPLINK, "addrgenmode", "none")
            _run("ip", "-n", ns, "addr", "add", f"{self.node_addr(node)}/24", "dev", UPLINK)
            _run("ip", "-n", ns, "link", "set", UPLINK, "up")
            self._shape(ns, UPLINK)
            self._shape(bridge, port)

    def counters(self, node: int) -> tuple[int, int]:
        """``(tx_bytes, rx_bytes)`` of node ``node``'s uplink."""
        info = json.loads(_run("ip", "-n", self.node_ns(node), "-j", "-s", "link", "show", "dev", UPLINK))
        stats = info[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def destroy(self) -> list[str]:
        """Delete every namespace this network created; returns the names that failed."""
        self.created = [name for name in reversed(self.created) if not _delete(name)]
        return self.created
