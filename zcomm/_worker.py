"""One FIFO worker thread per (process group, topology) for collectives that need host work between hops.

[Note: worker ordering] qgZ and qwZ on CPU tensors have host work between their hops
(each hop waits for the previous one's data; qgZ also dequantizes, reduces and
requantizes it), so an ``async_op=True`` call cannot just enqueue its chain the way CUDA
streams allow. The whole chain runs on a worker thread instead, and *every* call (sync
ones too, which then wait) goes through the same single-threaded FIFO queue: each rank
thus issues its collectives on zcomm's private subgroups in its own program order, which
is the same order on every member, as torch.distributed requires. The worker overlaps
with the caller's Python only as far as the quantization kernels release the GIL (the
``cpu`` backend's numba kernels are meant to; the ``reference`` backend's torch ops do
inside each op).
"""

from __future__ import annotations

import weakref
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

from .topology import Topology

# caller's group -> topology -> its single worker; weak in the group like zcomm._groups'
# cache ([Note: cache lifetime]): a worker whose group is gone is dropped, and its thread exits
_WORKERS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[Topology, ThreadPoolExecutor]] = weakref.WeakKeyDictionary()


def ordered_worker(group: dist.ProcessGroup, topology: Topology) -> ThreadPoolExecutor:
    """The single-threaded executor for ``group`` laid out as ``topology``, created on first use."""
    workers = _WORKERS.setdefault(group, {})
    if topology not in workers:
        # setdefault keeps the first one if two threads race here; an unused executor starts no thread
        workers.setdefault(topology, ThreadPoolExecutor(max_workers=1, thread_name_prefix="zcomm-worker"))
    return workers[topology]
