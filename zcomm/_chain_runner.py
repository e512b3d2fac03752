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

[Note: hop release] A gloo hop's ``Work`` holds the hop's tensors, and gloo's worker
thread drops its own reference to the ``Work`` only after running it: often after the
chain's ``wait()`` has returned and the chain has dropped its reference. The ``Work``'s
destructor then runs on gloo's thread, and releasing a tensor that has a Python object
there takes the GIL (torch keeps a tensor's Python object alive while C++ holds the
tensor). If the interpreter has begun finalizing by then (the chain was the program's
last collective, and the main thread reached its end within the GIL's switch interval),
CPython ends the thread that asks for the GIL with ``pthread_exit``, whose forced unwind
through the destructor (``noexcept``) calls ``std::terminate``: the process aborts with
"terminate called without an active exception" after finishing its work. torch's
``destroy_process_group()`` does not help here: it leaves gloo's threads running until
the group objects are freed, and the plans and prepared calls the caller holds keep
zcomm's subgroups. So a CPU chain hands its tensors to gloo through :func:`start_hop`,
which keeps them with their C++ use counts from before the hop, and the worker, once the
chain has run, waits (GIL released) until gloo has let go of every one of them (the count
back down); only then does the call's handle complete. Whichever thread destroys a
``Work``, nothing of it is left for gloo to release once the chain is done. The wait is
usually none: gloo releases while the chain dequantizes.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ._contract import Chain, Handle, Kind
from ._torch_compat import tensor_use_count
from .topology import Topology

# caller's group -> (topology, kind) -> its single worker; weak in the group. Only the plans
# (and the prepared calls holding them) hold a worker strongly ([Note: held workers])
_WORKERS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple[Topology, Kind], ThreadPoolExecutor]] = (
    weakref.WeakKeyDictionary()
)


# the CPU tensors this thread's chain handed to its hops, with their use counts before the hop ([Note: hop release])
class _HeldHops(threading.local):
    def __init__(self) -> None:
        self.hops: list[tuple[torch.Tensor, int]] = []


_HELD = _HeldHops()
_POLL_S = 1e-4
_RELEASE_TIMEOUT_S = 30.0  # gloo destroys a finished Work at once: a longer wait means a tensor escaped the chain


def start_hop(
    collective: Callable[..., dist.Work], received: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """``collective(received, send, group=group, async_op=True)``; on CPU, the two tensors are kept
    until gloo lets them go after the chain ([Note: hop release])."""
    if not received.is_cuda:
        _HELD.hops += ((received, tensor_use_count(received)), (send, tensor_use_count(send)))
    return collective(received, send, group=group, async_op=True)


def _run_and_release(chain: Chain) -> object:
    """``chain()`` on the worker, then the wait for gloo to release its hops' tensors ([Note: hop release]).

    A chain that raised may have left a hop running: its tensors are dropped without a wait, and
    its error propagates.
    """
    try:
        result = chain()
    except BaseException:
        _HELD.hops.clear()
        raise
    hops = _HELD.hops
    if hops:
        _release(hops)
    return result


def _release(hops: list[tuple[torch.Tensor, int]]) -> None:
    """Wait until no hop tensor of ``hops`` has more C++ references than before its hop, then drop them."""
    try:
        deadline = None
        for tensor, before in hops:
            while tensor_use_count(tensor) > before:
                if deadline is None:
                    deadline = time.monotonic() + _RELEASE_TIMEOUT_S
                elif time.monotonic() > deadline:
                    raise RuntimeError(
                        f"a hop's tensor of shape {tuple(tensor.shape)} is still held {_RELEASE_TIMEOUT_S:.0f} s after "
                        f"its chain ended ({tensor_use_count(tensor)} references, {before} before the hop)"
                    )
                time.sleep(_POLL_S)  # with the GIL released: gloo's thread needs it to release the tensor
    finally:
        hops.clear()


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
    future = worker.submit(_run_and_release, chain)
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
    chain's end event. The call's tensors are recorded on the side stream so the allocator
    keeps them until then. Chains of the two kinds use different NCCL communicators ([Note:
    kinds]) and different side streams, so a gather's hops are not serialized behind a
    reduce-scatter's. One kind's async chains share its side stream and so run in the order
    they were issued, as its NCCL communicator runs their hops anyway (and as the CPU
    worker runs them: [Note: worker ordering]).

    [Note: side stream per kind] The stream is made on the first async call and kept for the
    process: each async call then costs a cross-stream wait (one event), a switch of the
    current stream to the side stream and back (``torch.cuda.set_stream``, which affects
    only the calling thread), the end event and the tensors' ``record_stream``, instead of a
    new stream object and torch's ``torch.cuda.stream`` context per call. The wait is
    ``wait_stream``, which records a new event per call: an event shared between calls could
    be re-recorded by another thread between one call's record and its wait.
    """

    __slots__ = ("device", "_stream")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None

    def run(self, chain: Chain, tensors: Sequence[torch.Tensor]) -> Handle:
        """Enqueue ``chain()`` on the side stream behind the current stream's work, without blocking the host."""
        device = self.device
        side = self._stream
        if side is None:
            with _SIDE_LOCK:  # one stream even when two threads make the first call at once
                if self._stream is None:
                    self._stream = torch.cuda.Stream(device=device)
            side = self._stream
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        torch.cuda.set_stream(side)
        try:
            chain()
            done = torch.cuda.Event()
            done.record(side)
        finally:
            torch.cuda.set_stream(current)
        for tensor in tensors:
            tensor.record_stream(side)
        return Handle(finish=lambda: torch.cuda.current_stream(device).wait_event(done), ready=done.query)


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
