"""Life cycle of one simulated-cluster launch: check, build, run, report, always clean up.

Order: refuse plainly without root or iproute2; remove namespaces left by launches that
died; build the network; start the ranks; wait for all to succeed or one to fail; print each
node's uplink totals; then, in every case (failure, Ctrl-C, SIGTERM, SIGHUP), stop the ranks
still running and delete every namespace created. The signal handlers turn the signal into
an exception so the clean-up in ``finally`` runs (with those signals ignored until it is
done); the status is then ``128 + signal``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

from . import ranks
from .config import ClusterConfig
from .network import NetworkError, SimNetwork, remove_stale

_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stopped(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.status = 128 + signum


def _raise_stopped(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


def missing_prerequisite() -> str | None:
    """Why this machine cannot host a simulated cluster, or None if it can."""
    if os.geteuid() != 0:
        return ("bench.simcluster needs root (it creates network namespaces and tc qdiscs); run the suites under "
                "mpirun or torchrun on loopback instead")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"bench.simcluster needs iproute2 ({' and '.join(missing)} not found); install it, e.g. apt-get install -y iproute2"
    return None


def _run_ranks(network: SimNetwork, procs: list[subprocess.Popen]) -> int:
    network.build()
    procs.extend(ranks.start(network, network.config.command))
    status, failed = ranks.wait(procs)
    if failed is not None:
        print(f"# simcluster: rank {failed} exited with status {status}; stopping the others", file=sys.stderr)
    total = 0
    for node in range(network.config.num_nodes):
        tx, rx = network.counters(node)
        total += tx
        print(f"# simcluster node {node} ({network.node_addr(node)}): {tx} bytes sent, {rx} bytes received on its link")
    print(f"# simcluster: {total} bytes crossed between nodes", flush=True)
    return status


def launch(config: ClusterConfig) -> int:
    """Run ``config.command`` on the simulated cluster; returns the exit status."""
    problem = missing_prerequisite()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    for name in remove_stale():
        print(f"# simcluster: removed namespace {name} left by an earlier launch", file=sys.stderr)
    network = SimNetwork(config)
    procs: list[subprocess.Popen] = []
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in _HANDLED}
    try:
        return _run_ranks(network, procs)
    except NetworkError as exc:
        print(f"bench.simcluster: could not set up the network: {exc}", file=sys.stderr)
        return 2
    except (_Stopped, KeyboardInterrupt) as exc:
        print(f"# simcluster: interrupted ({exc or 'SIGINT'}); cleaning up", file=sys.stderr)
        return exc.status if isinstance(exc, _Stopped) else 130
    finally:
        # A second Ctrl-C must not cut the clean-up short.
        for sig in _HANDLED:
            signal.signal(sig, signal.SIG_IGN)
        ranks.terminate(procs)
        for name in network.destroy():
            print(f"bench.simcluster: could not delete namespace {name}", file=sys.stderr)
        for sig, old in previous.items():
            signal.signal(sig, old)
