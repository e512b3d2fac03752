"""The throughput of one inter-node link, measured: what turns wire bytes into wire time.

Under ``bench.simcluster`` a step is communication-bound when its inter-node bytes (from the
uplink counters, TCP/IP headers included: :mod:`.wire`) take about as long to cross a link as
the whole step; both are measured in the same unit.

[Note: link probe] Rank 0 (node 0) sends one buffer to the first rank of node 1 and waits
for a one-element reply, so the clock stops when the last byte has arrived, not when the
kernel has queued it; the throughput is the bytes node 0's uplink sent in that time over
the time. The buffer doubles from ``FIRST_BYTES`` until a transfer lasts ``MIN_SECONDS``
(so the shaper's burst and the connection's warm-up are a small part of it) or reaches
``MAX_BYTES``. Every other rank waits in the barriers; rank 0 broadcasts each result, so
all ranks take the same branch.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .dist_env import DistContext
from .timing import reduce_over_ranks
from .wire import read_wire_bytes

FIRST_BYTES = 1 << 20
MAX_BYTES = 64 << 20
MIN_SECONDS = 0.3


def _probe(ctx: DistContext, nbytes: int, peer: int) -> tuple[int, float]:
    """One transfer of ``nbytes`` from rank 0 to ``peer``: (bytes on node 0's uplink, seconds), on rank 0."""
    rank = ctx.env.rank
    payload = torch.empty(nbytes if rank in (0, peer) else 0, dtype=torch.uint8, device=ctx.device)
    reply = torch.zeros(1, dtype=torch.uint8, device=ctx.device)
    dist.barrier()
    sent, elapsed = 0, 0.0
    if rank == 0:
        before = read_wire_bytes()
        began = time.perf_counter()
        dist.send(payload, dst=peer)
        dist.recv(reply, src=peer)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        elapsed = time.perf_counter() - began
        after = read_wire_bytes()
        assert before is not None and after is not None, "the probe runs only where the counters exist"
        sent = after[0] - before[0]
    elif rank == peer:
        dist.recv(payload, src=0)
        dist.send(reply, dst=0)
    dist.barrier()
    return sent, elapsed


def measure_link_throughput(ctx: DistContext) -> float | None:
    """Bytes per second one node's uplink carries (see [Note: link probe]); collective.

    None when there is no second node or no wire counters (not under ``bench.simcluster``),
    decided alike on every rank.
    """
    (has_counters,) = reduce_over_ranks([float(read_wire_bytes() is not None)], dist.ReduceOp.MIN, device=ctx.device)
    if ctx.env.num_nodes < 2 or not has_counters:
        return None
    nbytes = FIRST_BYTES
    while True:
        result = torch.tensor(_probe(ctx, nbytes, peer=ctx.env.local_size), dtype=torch.float64, device=ctx.device)
        dist.broadcast(result, src=0)
        sent, elapsed = result.tolist()
        if elapsed >= MIN_SECONDS or nbytes >= MAX_BYTES:
            return sent / elapsed
        nbytes *= 2
