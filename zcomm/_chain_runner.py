"""Running a hierarchical collective's chain of hops in the same order on every rank.

A hierarchical collective (qwZ's 2-hop all-gather, qgZ's 2-hop reduce-scatter) is a chain:
quantize, a hop on one of zcomm's private subgroups (:mod:`zcomm._groups`), work on what
arrived, the next hop, and so on. A hop may only start once the previous one has
delivered, so the chain cannot be issued up front as one asynchronous collective; and
every member must issue its hops on each private group in the same order.

* CUDA: the chain is enqueued on a stream without blocking the host ([Note: CUDA streams]).
* CPU: the chain runs on the ordered worker of the caller's (group, topology, kind), which
  the collective's plan holds ([Note: worker ordering], [Note: held workers]).

Each :data:`~zcomm._contract.Kind` of collective (``"gather"``: qwZ, ``"reduce"``: qgZ) has its
own private subgroups ([Note: kinds]) and, on CPU, its own worker, so the two kinds are
independent streams of work: a gather issued while a reduce-scatter is in flight runs at
once, on its own groups, instead of queueing behind it.

[Note: worker ordering] qgZ and qwZ on CPU tensors have host work between their hops
(each hop waits for the previous one's data; qgZ also dequantizes, reduces and
requantizes it), so an ``async_op=True`` call cannot just enqueue its chain the way CUDA
streams allow. The whole chain runs on a worker thread instead, and *every* call of a kind
(sync ones too, which then wait) goes through that kind's single-threaded FIFO queue:
each rank thus issues the collectives of a kind on that kind's private subgroups in its
own program order, which is the same order on every member, as torch.distributed
requires, and no private group is ever used from two threads at once. Two kinds run
concurrently on different groups (torch allows collectives on different groups to be in
flight together), so the guarantees are: the calls of one kind complete in program
order; a call of one kind never waits for a call of the other. The worker overlaps with
the caller's Python only as far as the quantization kernels release the GIL (the ``cpu``
backend's numba kernels are meant to; the ``reference`` backend's torch ops do inside
each op).

A CPU chain's gloo hops keep their tensors until gloo has let go of them, and the process
waits for that at exit ([Note: hop release] in :mod:`zcomm._hop_release`): the worker
settles them after each chain.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ._contract import Chain, Handle, Kind
from ._hop_release import settle
from .topology import Topology

# caller's group -> (topology, kind) -> its single worker; weak in the group. Only the plans
# (and the prepared calls holding them) hold a worker strongly ([Note: held workers])
_WORKERS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[Topology, Kind], ThreadPoolExecutor]] = (
    weakref.WeakKeyDictionary()
)


def _run_and_settle(chain: Chain) -> object:
    """``chain()`` on the worker, then its hops' tensors settled ([Note: hop release]), whether or not it raised."""
    try:
        return chain()
    finally:
        settle()


def run_chain(chain: Chain, tensors: Sequence[torch.Tensor], async_op: bool, worker: Runner) -> Handle | None:
    """Run a collective's ``chain()``; a handle if ``async_op``, else wait.

    ``tensors`` are the call's inputs and outputs (all on one device): on CUDA they are kept
    for the allocator until the chain has run ([Note: CUDA streams]). ``worker`` is the one
    :func:`chain_worker` gave the collective's plan for its group, topology, kind and device:
    the kind's FIFO worker on CPU, its :class:`SideStream` on CUDA.
    """
    if tensors[0].is_cuda:
        if not async_op:
            chain()
            return None
        return worker.run(chain, tensors)
    # Sync calls queue behind pending async ones of their kind (see [Note: worker ordering]).
    future = worker.submit(_run_and_settle, chain)
    handle = Handle(finish=future.result, ready=future.done)
    if async_op:
        return handle
    handle.wait()
    return None


def chain_worker(group: dist.ProcessGroup, topology: Topology, kind: Kind, device: torch.device) -> Runner:
    """The worker that runs ``kind``'s chains on ``group`` laid out as ``topology`` for tensors on
    ``device`` (on CUDA, where chains are enqueued on streams, the kind's :class:`SideStream`
    of the device), for a plan to hold and pass to :func:`run_chain`.

    [Note: held workers] A plan resolves its worker once instead of per call. It is the very
    executor of :data:`_WORKERS` for its (group, topology, kind), so every call of the kind
    still goes through one FIFO queue ([Note: worker ordering]). :data:`_WORKERS` holds its
    group weakly and its executors only as long as the group lives; the plans hold them
    strongly, and a plan goes with its group ([Note: plan cache lifetime] in
    :mod:`zcomm._plan_cache`) or with the prepared call that holds it. An executor nothing
    holds is collected, and its thread exits once the chains queued on it have run (a
    ``ThreadPoolExecutor``'s thread watches its executor through a weak reference). So a
    group's threads end with the group, and one group's plans share its threads.
    """
    if device.type == "cuda":
        return _side_stream(device, kind)
    return _ordered_worker(group, topology, kind)


def _ordered_worker(group: dist.ProcessGroup, topology: Topology, kind: Kind) -> ThreadPoolExecutor:
    """The single-threaded executor for ``kind``'s calls on ``group`` laid out as ``topology``."""
    workers = _WORKERS.setdefault(group, {})
    key = (topology, kind)
    if key not in workers:
        # setdefault keeps the first one if two threads race here; an unused executor starts no thread
        workers.setdefault(key, ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"zcomm-worker-{kind}"))
    return workers[key]


class SideStream:
    """Where ``async_op=True`` chains of one kind run on one CUDA device.

    [Note: CUDA streams] Sync calls run on the current stream (NCCL's ``work.wait()`` makes
    it wait for each hop). Async calls run on the kind's side stream of the device, which
    first waits for the current stream; ``wait()`` makes the current stream wait for the
    chain's end event. The call's tensors are kept referenced until that event has
    completed ([Note: side-stream buffers by events]). Chains of the two kinds use different
    NCCL communicators ([Note: kinds]) and different side streams, so a gather's hops are not
    serialized behind a reduce-scatter's. One kind's async chains share its side stream and so
    run in the order they were issued, as its NCCL communicator runs their hops anyway (and as
    the CPU worker runs them: [Note: worker ordering]).

    [Note: side stream per kind] The stream is made on the first async call and kept for the
    process: each async call then costs a cross-stream wait (one event), a switch of the
    current stream to the side stream and back (``torch.cuda.set_stream``, which affects
    only the calling thread) and the end event, instead of a new stream object and torch's
    ``torch.cuda.stream`` context per call. The wait is ``wait_stream``, which records a new
    event per call: an event shared between calls could be re-recorded by another thread
    between one call's record and its wait.

    [Note: side streams keep the current device] ``torch.cuda.set_stream`` also makes the
    stream's device the current device. The chain runs with it (its kernels and allocations
    belong there), and the caller's current device is restored afterwards when it was
    another one: an async collective on a tensor of one GPU never moves a caller, whose
    later ``torch.cuda.current_device()`` (NCCL's object collectives, ``barrier``) would
    otherwise name the wrong GPU.

    [Note: side-stream buffers by events] The call's tensors (allocated by the caller on its
    stream, used by the chain on the side stream) are not ``record_stream``-ed on the side
    stream: a block recorded so is handed out again only after all the work queued on the
    side stream *when it is freed* has finished, so a unit freed while the next units'
    gathers are queued (stage 3 with prefetching) stays reserved until those finish, and the
    peak grows with the prefetch depth (FSDP1's problem, which FSDP2 solved this way). The
    side stream keeps each call's tensors referenced, with its end event, until a later call
    or ``wait()`` finds the event completed (the events of one stream complete in order, so
    only the oldest is queried). A caller that frees a tensor after ``wait()`` on the stream
    it allocated the tensor on (as the ZeRO runtime does, also by resizing the storage) frees
    it behind the chain's end; one that drops it early loses nothing: the reference held
    here keeps the block until the chain has finished on the GPU.
    """

    __slots__ = ("device", "_stream", "_pending", "_lock")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        # (end event, the call's tensors) of chains whose end has not been seen to complete, oldest first
        self._pending: deque[tuple[torch.cuda.Event, Sequence[torch.Tensor]]] = deque()
        self._lock = threading.Lock()

    def run(self, chain: Chain, tensors: Sequence[torch.Tensor]) -> Handle:
        """Enqueue ``chain()`` on the side stream behind the current stream's work, without blocking the host."""
        device = self.device
        side = self._stream
        if side is None:
            with _SIDE_LOCK:  # one stream even when two threads make the first call at once
                if self._stream is None:
                    self._stream = torch.cuda.Stream(device=device)
            side = self._stream
        previous = torch.cuda.current_device()
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        torch.cuda.set_stream(side)  # also makes ``device`` current: [Note: side streams keep the current device]
        try:
            chain()
            done = torch.cuda.Event()
            done.record(side)
        finally:
            torch.cuda.set_stream(current)
            if previous != device.index:
                torch.cuda.set_device(previous)
        self._release_finished()
        with self._lock:
            self._pending.append((done, tensors))

        def finish() -> None:
            torch.cuda.current_stream(device).wait_event(done)
            self._release_finished()

        return Handle(finish=finish, ready=done.query)

    def _release_finished(self) -> None:
        """Drop the tensors of the chains whose end event completed ([Note: side-stream buffers by events])."""
        pending = self._pending
        with self._lock:
            while pending and pending[0][0].query():
                pending.popleft()


# what runs a plan's chains: the CPU worker of its (group, topology, kind), or the side stream of its (CUDA device, kind)
Runner = ThreadPoolExecutor | SideStream

# (device, kind) -> its side stream, made on the first plan of the pair; a few per device, kept for the process
_SIDE_STREAMS: dict[tuple[torch.device, Kind], SideStream] = {}
_SIDE_LOCK = threading.Lock()


def _side_stream(device: torch.device, kind: Kind) -> SideStream:
    """The :class:`SideStream` of ``kind`` on ``device`` (an indexed CUDA device)."""
    assert device.index is not None, "a CUDA tensor's device has an index"
    side = _SIDE_STREAMS.get((device, kind))
    if side is None:
        with _SIDE_LOCK:
            side = _SIDE_STREAMS.setdefault((device, kind), SideStream(device))
    return side
