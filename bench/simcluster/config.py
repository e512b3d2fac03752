"""What cluster to simulate: number of nodes, ranks per node (local size), link rate, and the command."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Sequence

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
MAX_NODES = 250  # the nodes' addresses: 10.213.0.1 to .250 (bench.simcluster.network)


def parse_rate(text: str) -> int | None:
    """``"200mbit"`` -> 200_000_000 bits per second (tc's SI units); ``"unlimited"`` -> None (no shaping)."""
    if text.strip().lower() == "unlimited":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", text.strip(), re.IGNORECASE)
    if match is None:
        raise ValueError(f"rate must look like 200mbit (units {', '.join(_RATE_UNITS)}), got {text!r}")
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2).lower()]
    if bits < 8000:
        raise ValueError(f"rate must be at least 8kbit, got {text!r}")
    return int(bits)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """``num_nodes`` namespaces of ``local_size`` ranks each; every node's link limited to ``rate_bps`` both
    ways (None: unshaped, as fast as the veth pairs and the machine's cores carry them)."""

    num_nodes: int
    local_size: int
    rate_bps: int | None
    command: tuple[str, ...]

    def __post_init__(self) -> None:
        if not 1 <= self.num_nodes <= MAX_NODES:
            raise ValueError(f"--num-nodes must be in 1..{MAX_NODES}, got {self.num_nodes}")
        if self.local_size < 1:
            raise ValueError(f"--local-size must be >= 1, got {self.local_size}")
        if not self.command:
            raise ValueError("no command given: put it after --, e.g. -- python -m bench.collectives")

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.local_size


def launch_argv(num_nodes: int, local_size: int, rate: str, command: Sequence[str]) -> list[str]:
    """The ``python -m bench.simcluster`` command line that runs ``command`` on such a cluster (the demo, the sweep)."""
    return [sys.executable, "-m", "bench.simcluster", "--num-nodes", str(num_nodes), "--local-size", str(local_size),
            "--rate", rate, "--", *command]  # fmt: skip


def parse_config(argv: Sequence[str] | None = None) -> ClusterConfig:
    """Parse the launcher's arguments; bad values exit through argparse (status 2)."""
    parser = argparse.ArgumentParser(
        prog="python -m bench.simcluster",
        description="Run CMD as num-nodes x local-size ranks on a simulated cluster of network namespaces (needs root).",
        usage="%(prog)s --num-nodes N --local-size L --rate 200mbit -- CMD ...",
        allow_abbrev=False,  # --local is not --local-size
    )
    parser.add_argument("--num-nodes", type=int, required=True, help="number of simulated nodes")
    parser.add_argument("--local-size", type=int, required=True, help="ranks per node (zcomm's local_size)")
    parser.add_argument("--rate", required=True,
                        help="each node's link rate, both directions (tc units: 200mbit), or 'unlimited'")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    args = parser.parse_args(argv)
    command = tuple(args.command[1:] if args.command[:1] == ["--"] else args.command)
    try:
        return ClusterConfig(num_nodes=args.num_nodes, local_size=args.local_size, rate_bps=parse_rate(args.rate),
                             command=command)
    except ValueError as exc:
        parser.error(str(exc))
