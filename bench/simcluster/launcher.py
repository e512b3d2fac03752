"""Life cycle of one simulated-cluster launch: check, build, start and supervise the ranks, report, clean up.

It refuses plainly without root or iproute2 and removes namespaces left by launches that died.
The first rank that fails sets the status; then, in every case (failure, Ctrl-C, SIGTERM,
SIGHUP), the ranks still running are stopped and every namespace created is deleted: the
signal handlers raise, so the clean-up in ``finally`` runs (those signals ignored until it is
done), and the status is then ``128 + signal``.

Rank ``r`` runs on node ``r // local_size`` (node-major, as zcomm's topology expects) in its own
session (signalled as a process group), with torchrun's variables, ``GLOO_SOCKET_IFNAME`` (gloo
binds to the node's address; the node's other ranks reach it over loopback, off the link),
``ZCOMM_LOCAL_SIZE``, ``ZCOMM_WIRE_IFACE`` (:mod:`bench.harness.wire`) and, unless set, its
share of the cores as ``OMP_NUM_THREADS`` (as torchrun does: ranks must not spin against each other).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from typing import Mapping, Sequence

from ..harness.wire import WIRE_IFACE_ENV
from .config import ClusterConfig
from .network import UPLINK, NetworkError, SimNetwork, remove_stale

GRACE_S = 5.0
_POLL_S = 0.05
# Launcher variables that would make a rank think it runs under MPI instead.
_FOREIGN = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")


def thread_share(world_size: int, cores: int | None = None) -> int:
    """CPU threads per rank when ``world_size`` ranks share this machine's cores (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return max(1, cores // world_size)


def rank_env(config: ClusterConfig, rank: int, master_addr: str, master_port: int, base: Mapping[str, str]) -> dict[str, str]:
    """The environment of ``rank``: ``base`` plus the launcher's variables."""
    env = {key: value for key, value in base.items() if key not in _FOREIGN}
    env.setdefault("OMP_NUM_THREADS", str(thread_share(config.world_size)))
    # The namespaces have no resolver entries for their addresses, so c10d would warn on
    # every connection that it cannot name the peer; keep its errors, drop those warnings.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env.update(RANK=str(rank), WORLD_SIZE=str(config.world_size), LOCAL_RANK=str(rank % config.local_size),
               LOCAL_WORLD_SIZE=str(config.local_size), GROUP_RANK=str(rank // config.local_size),
               MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), GLOO_SOCKET_IFNAME=UPLINK,
               ZCOMM_LOCAL_SIZE=str(config.local_size), **{WIRE_IFACE_ENV: UPLINK})
    return env


def exit_status(returncode: int) -> int:
    """A shell-style status: ``128 + n`` for signal ``n``."""
    return 128 - returncode if returncode < 0 else returncode


def wait(procs: Sequence[subprocess.Popen]) -> tuple[int, int | None]:
    """Wait until all ranks succeed or one fails: ``(status, failing rank or None)``."""
    while True:
        codes = [proc.poll() for proc in procs]
        for rank, code in enumerate(codes):
            if code:
                return exit_status(code), rank
        if all(code == 0 for code in codes):
            return 0, None
        time.sleep(_POLL_S)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def terminate(procs: Sequence[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """SIGTERM the process group (own session) of every process still running, SIGKILL what is left
    after ``grace_s``, reap all: the ranks here, a gpu-check stage (:mod:`bench.gpu_check.stages`)."""
    running = [proc for proc in procs if proc.poll() is None]
    for proc in running:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


_HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class _Stopped(Exception):
    """Raised by the handler of a signal in ``_HANDLED``, with its number."""


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
    """Build the network, start every rank into ``procs`` (the caller :func:`terminate` s them), wait, report."""
    config = network.config
    network.build()
    # Node 0's namespace is new and holds only our ranks, and the kernel hands out ephemeral
    # ports from 32768 up, so any port below that is free there: no probing needed.
    port = random.randrange(20000, 30000)
    for rank in range(config.world_size):
        argv = ["ip", "netns", "exec", network.node_ns(rank // config.local_size), *config.command]
        env = rank_env(config, rank, network.node_addr(0), port, os.environ)
        procs.append(subprocess.Popen(argv, env=env, start_new_session=True))
    status, failed = wait(procs)
    if failed is not None:
        print(f"# simcluster: rank {failed} exited with status {status}; stopping the others", file=sys.stderr)
    counters = [network.counters(node) for node in range(config.num_nodes)]
    for node, (tx, rx) in enumerate(counters):
        print(f"# simcluster node {node} ({network.node_addr(node)}): {tx} bytes sent, {rx} bytes received on its link")
    print(f"# simcluster: {sum(tx for tx, _ in counters)} bytes crossed between nodes", flush=True)
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
    except _Stopped as exc:
        (signum,) = exc.args
        print(f"# simcluster: interrupted ({signal.Signals(signum).name}); cleaning up", file=sys.stderr)
        return 128 + signum
    finally:
        # A second Ctrl-C must not cut the clean-up short.
        for sig in _HANDLED:
            signal.signal(sig, signal.SIG_IGN)
        terminate(procs)
        for name in network.destroy():
            print(f"bench.simcluster: could not delete namespace {name}", file=sys.stderr)
        for sig, old in previous.items():
            signal.signal(sig, old)
