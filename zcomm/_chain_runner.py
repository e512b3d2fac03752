"""Running a hierarchical collective's chain of hops in the same order on every rank.

A hierarchical collective (qwZ's 2-hop all-gather, qgZ's 2-hop reduce-scatter) is a chain:
quantize, a hop on one of zcomm's private subgroups (:mod:`zcomm._groups`), work on what
arrived, the next hop, and so on. A hop may only start once the previous one has
delivered, so the chain cannot be issued up front as one asynchronous collective; and
every member must issue its hops on each private group in the same order.

* CUDA: the chain is enqueued on a stream without blocking the host ([Note: CUDA streams]).
* CPU: the chain runs on the ordered worker of the caller's (group, topology)
  ([Note: worker ordering]). All of zcomm's chains on one group share that worker, so the
  hops of a qwZ call and of a qgZ call in flight together never interleave on the private
  groups they share.

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

import torch
import torch.distributed as dist

from ._api import Chain, GroupInfo, Handle
from .topology import Topology

# caller's group -> topology -> its single worker; weak in the group like zcomm._groups'
# cache ([Note: cache lifetime]): a worker whose group is gone is dropped, and its thread exits
_WORKERS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[Topology, ThreadPoolExecutor]] = weakref.WeakKeyDictionary()


def run_chain(
    chain: Chain, info: GroupInfo, output: torch.Tensor, input: torch.Tensor, async_op: bool
) -> Handle | None:
    """Run ``chain(output, input)`` for a collective on ``info``'s group; a handle if ``async_op``, else wait."""
    if input.is_cuda:
        return _run_on_stream(chain, output, input, async_op)
    # [Note: worker ordering] sync calls queue behind pending async ones.
    future = _ordered_worker(info.group, info.topology).submit(chain, output, input)
    handle = Handle(finish=future.result, ready=future.done)
    if async_op:
        return handle
    handle.wait()
    return None


def _ordered_worker(group: dist.ProcessGroup, topology: Topology) -> ThreadPoolExecutor:
    """The single-threaded executor for ``group`` laid out as ``topology``, created on first use."""
    workers = _WORKERS.setdefault(group, {})
    if topology not in workers:
        # setdefault keeps the first one if two threads race here; an unused executor starts no thread
        workers.setdefault(topology, ThreadPoolExecutor(max_workers=1, thread_name_prefix="zcomm-worker"))
    return workers[topology]


def _run_on_stream(chain: Chain, output: torch.Tensor, input: torch.Tensor, async_op: bool) -> Handle | None:
    """CUDA: enqueue the whole chain without blocking the host.

    [Note: CUDA streams] Sync calls run on the current stream (NCCL's ``work.wait()`` makes
    it wait for each hop). Async calls run on a side stream that first waits for the current
    one; ``wait()`` makes the current stream wait for the chain's end event. ``input`` and
    ``output`` are recorded on the side stream so the allocator keeps them until then.
    """
    if not async_op:
        chain(output, input)
        return None
    current = torch.cuda.current_stream(input.device)
    side = torch.cuda.Stream(device=input.device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        chain(output, input)
        done = torch.cuda.Event()
        done.record(side)
    input.record_stream(side)
    output.record_stream(side)
    return Handle(finish=lambda: torch.cuda.current_stream(input.device).wait_event(done), ready=done.query)
