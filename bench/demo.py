"""``make demo``: the collectives suite on a simulated 2-node x 2-rank cluster at 200 Mbit/s.

bf16, 1 MiB to 64 MiB, torch's collectives against zcomm's, ``reduce_scatter_q4`` with one
and with four pipeline stages. At 200 Mbit/s one 64 MiB torch reduce-scatter takes seconds,
so the iteration counts are small; the whole sweep takes a few minutes on 2 cores. Without
root or iproute2 it warns and runs the same sweep under mpirun on plain loopback, with
``ZCOMM_LOCAL_SIZE=2`` so zcomm still sees two nodes (but no link is limited or counted).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .simcluster.launcher import missing_prerequisite

NODES, LOCAL, RATE = 2, 2, "200mbit"
SUITE = ("-b", "1M", "-e", "64M", "-f", "2", "-n", "2", "-w", "1", "-d", "bfloat16", "--stages", "1,4")


def command(simulated: bool) -> list[str]:
    suite = [sys.executable, "-m", "bench.collectives", *SUITE]
    if simulated:
        launcher = [sys.executable, "-m", "bench.simcluster", "--nodes", str(NODES), "--local", str(LOCAL), "--rate", RATE]
        return [*launcher, "--", *suite]
    mpirun = Path(sys.executable).parent / "mpirun"
    return [str(mpirun) if mpirun.exists() else "mpirun", "-n", str(NODES * LOCAL), *suite]


def main() -> int:
    problem = missing_prerequisite()
    if problem:
        print(f"WARNING: {problem}\nWARNING: running on plain loopback: no 200 Mbit/s link, no wire bytes.", file=sys.stderr)
    argv = command(simulated=problem is None)
    print("$ " + " ".join(argv), flush=True)
    env = dict(os.environ, ZCOMM_LOCAL_SIZE=str(LOCAL))
    return subprocess.run(argv, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
