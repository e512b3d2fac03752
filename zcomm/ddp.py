"""A DDP communication hook that averages each gradient bucket with :func:`zcomm.all_reduce_q4`.

``DistributedDataParallel`` flattens the gradients into buckets (25 MiB by default) and, once a
bucket's gradients are all computed, calls its communication hook with it; the hook returns a
``torch.futures.Future`` whose value is the bucket averaged over the process group, which DDP
copies into the parameters' ``.grad``. This hook runs zcomm's quantized hierarchical
all-reduce (INT4 reduce-scatter with fp32 sums, INT8 gather; see :mod:`zcomm.all_reduce_q4`
for the algorithm, the bytes and the error bound) with ``op=AVG``::

    state = zcomm.ddp.QuantizedAllReduceState(group=None, first_hop_bits=8)
    model = DistributedDataParallel(module)
    model.register_comm_hook(state, zcomm.ddp.quantized_allreduce_hook)

What DDP does around the hook works unchanged, because the hook only replaces the bucket's
all-reduce: ``no_sync()`` and gradient accumulation (no hook call inside ``no_sync``; the next
synchronized backward reduces the accumulated bucket), ``find_unused_parameters`` (the
unused parameters' slots of a bucket are zeros), ``static_graph`` and
``gradient_as_bucket_view``. Every rank calls the hook for the same buckets in the same order
(DDP launches buckets in index order), which the collective's ordering needs.

[Note: hook state per bucket] The state keeps, per bucket index, an all-reduce prepared for the
bucket's numel, dtype and device (:func:`zcomm.prepare_all_reduce_q4`: resolved once, not per
step) and, with ``error_feedback=True``, the bucket's :class:`zcomm.ErrorFeedback`. DDP
rebuilds its buckets once after the first iteration (in the order gradients arrived); a bucket
whose numel, dtype or device changed gets a new prepared call and fresh error feedback.
Preparing may create zcomm's private subgroups, a collective step that every rank takes at the
same bucket.

[Note: hook overlap on CPU] On CPU the hook starts the bucket's all-reduce asynchronously: the
reduce-scatter is issued at once, on the autograd thread, in bucket order, and runs on zcomm's
reduce worker while backward goes on; the gather ([Note: all-reduce async] in
:mod:`zcomm.all_reduce_q4`) and the future's completion run on this module's single FIFO
thread, which takes the buckets in the order the hook was called. Every rank thus issues its
gathers in bucket order on the gather kind's private groups, as their ordering needs, so
other zcomm gathers on the same group must not be issued from another thread while a
backward is in flight. DDP waits for the futures at the end of backward. On CUDA the hook
enqueues the all-reduce on a side stream of the state that waits for the current stream, and
the future is completed on that side stream, so DDP's wait makes its stream wait for the
reduction's end, not for the host: backward kernels keep running meanwhile.

Where DDP's contract cannot be met the hook raises ``TypeError`` before communicating anything
(backward then raises with its message): a bucket of another dtype than fp32, bf16 or fp16
(fp64 or complex parameters) or of sparse gradients, and a state that is not a
:class:`QuantizedAllReduceState`. ``state.group``
must be DDP's process group (both default to the world); the hook cannot see DDP's. DDP's
``Join`` context (uneven inputs) shadows the all-reduces of joined ranks with its own and is
not supported.
"""

# No ``from __future__ import annotations`` here: DDP's register_comm_hook compares the hook's
# annotations with the objects dist.GradBucket and Future[Tensor], and would refuse strings.
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from . import quant
from ._contract import Handle
from ._error_feedback import ErrorFeedback
from .all_reduce_q4 import PreparedAllReduceQ4, check_gather, prepare_all_reduce_q4
from .quant import SUPPORTED_DTYPES
from .reduce_scatter_q4 import check_first_hop_bits, check_hadamard_block
from .topology import Topology

__all__ = ["QuantizedAllReduceState", "quantized_allreduce_hook"]


@dataclass(kw_only=True)
class QuantizedAllReduceState:
    """The hook's state: the group, the all-reduce's options and what it keeps per bucket.

    Args:
        group: DDP's process group (default: world).
        group_size, gather_bits, gather_group_size, pipeline_stages, topology, first_hop_bits,
            hadamard_block: :func:`zcomm.all_reduce_q4`'s, for every bucket.
        error_feedback: give each bucket its own :class:`zcomm.ErrorFeedback` (LoCo) for the
            reduce-scatter's INT4 hops, with ``err_beta`` and ``reset_T``. Not with
            ``first_hop_bits=8`` or ``hadamard_block`` (the reduce-scatter refuses them).
    """

    group: dist.ProcessGroup | None = None
    group_size: int | Literal["tensor"] | None = None
    gather_bits: Literal[4, 8] | None = 8
    gather_group_size: int | Literal["tensor"] | None = None
    pipeline_stages: int | None = None
    topology: Topology | None = None
    first_hop_bits: int = 4
    hadamard_block: int | None = None
    error_feedback: bool = False
    err_beta: float = 0.8
    reset_T: int = 1024
    # bucket index -> its signature, prepared call and error feedback (see [Note: hook state per bucket])
    _buckets: dict[int, tuple[tuple, PreparedAllReduceQ4, ErrorFeedback | None]] = field(
        default_factory=dict, init=False, repr=False)
    _streams: dict[torch.device, torch.cuda.Stream] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.group is not None and not isinstance(self.group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(self.group).__name__}")
        if self.topology is not None and not isinstance(self.topology, Topology):
            raise TypeError(f"topology must be a zcomm.Topology or None, got {type(self.topology).__name__}")
        quant.QuantSpec(bits=4, group_size=self.group_size)
        check_gather(self.gather_bits, self.gather_group_size)
        stages = self.pipeline_stages
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int) or stages < 1):
            raise ValueError(f"pipeline_stages must be an int >= 1 or None, got {stages!r}")
        check_first_hop_bits(self.first_hop_bits)
        check_hadamard_block(self.hadamard_block)
        if not isinstance(self.error_feedback, bool):
            raise TypeError(f"error_feedback must be a bool, got {self.error_feedback!r}")
        ErrorFeedback(self.err_beta, self.reset_T)  # checks both
        if self.error_feedback and (self.first_hop_bits == 8 or self.hadamard_block is not None):
            raise ValueError("error_feedback cannot be combined with first_hop_bits=8 or hadamard_block "
                             "(the reduce-scatter's error feedback models INT4 hops of unrotated values)")

    @property
    def bucket_feedback(self) -> dict[int, ErrorFeedback]:
        """Bucket index -> its error feedback (empty without ``error_feedback``), e.g. to checkpoint it."""
        return {index: feedback for index, (_, _, feedback) in self._buckets.items() if feedback is not None}

    def _bucket(self, index: int, buffer: torch.Tensor) -> tuple[PreparedAllReduceQ4, ErrorFeedback | None]:
        """The bucket's prepared all-reduce and error feedback ([Note: hook state per bucket])."""
        signature = (buffer.numel(), buffer.dtype, buffer.device)
        entry = self._buckets.get(index)
        if entry is None or entry[0] != signature:
            prepared = prepare_all_reduce_q4(
                buffer, dist.ReduceOp.AVG, self.group, group_size=self.group_size, gather_bits=self.gather_bits,
                gather_group_size=self.gather_group_size, pipeline_stages=self.pipeline_stages,
                topology=self.topology, with_error_feedback=self.error_feedback, first_hop_bits=self.first_hop_bits,
                hadamard_block=self.hadamard_block)
            feedback = ErrorFeedback(self.err_beta, self.reset_T) if self.error_feedback else None
            entry = self._buckets[index] = (signature, prepared, feedback)
        return entry[1], entry[2]

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            with _STREAM_LOCK:
                stream = self._streams.setdefault(device, torch.cuda.Stream(device=device))
        return stream


_STREAM_LOCK = threading.Lock()
# the buckets' gathers and futures on CPU, in hook order ([Note: hook overlap on CPU]); one per process
_FINISHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zcomm-ddp-hook")


def quantized_allreduce_hook(state: QuantizedAllReduceState,
                             bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: ``bucket.buffer()`` averaged over ``state.group`` by :func:`zcomm.all_reduce_q4`,
    in place, as the value of the returned future (see the module docstring)."""
    if not isinstance(state, QuantizedAllReduceState):
        raise TypeError(f"quantized_allreduce_hook needs a zcomm.ddp.QuantizedAllReduceState, got "
                        f"{type(state).__name__}: register_comm_hook(QuantizedAllReduceState(...), hook)")
    buffer = bucket.buffer()
    if buffer.layout != torch.strided or buffer.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"quantized_allreduce_hook: bucket {bucket.index()} holds {buffer.layout} {buffer.dtype} "
                        "gradients; the quantized all-reduce takes dense fp32, bf16 or fp16 gradients only: keep "
                        "these parameters out of this DDP module or use DDP's default hook")
    prepared, feedback = state._bucket(bucket.index(), buffer)
    if not buffer.is_cuda:  # [Note: hook overlap on CPU]
        handle = prepared(buffer, async_op=True, error_feedback=feedback)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        _FINISHER.submit(_finish, handle, buffer, future)
        return future
    device = buffer.device
    side = state._stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        prepared(buffer, error_feedback=feedback)
        future = torch.futures.Future(devices=[device])
        future.set_result(buffer)  # records the side stream's position: DDP's wait waits for it
    buffer.record_stream(side)
    return future


def _finish(handle: Handle, buffer: torch.Tensor, future: torch.futures.Future) -> None:
    """On the finisher thread: the bucket's gather (inside ``wait()``), then its future."""
    try:
        handle.wait()
    except BaseException as exc:  # DDP's wait raises it on the autograd thread
        future.set_exception(exc)
        return
    future.set_result(buffer)
