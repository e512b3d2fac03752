"""HSDP under :func:`zcomm.fsdp.enable_zeropp`: each unit's reduce-scatter output all-reduced across the replicas.

Hybrid sharding shards a model inside a group of ranks (a node) and replicates it across
such groups. FSDP2's own HSDP (``fully_shard`` on a 2-D mesh) runs its replicate all-reduce
with ``torch.distributed.all_reduce`` and lets nobody replace it. zcomm's HSDP therefore
shards on the 1-D shard mesh only and adds the replication itself, through
``FSDPModule.set_all_reduce_hook``: FSDP2 calls ``hook(reduce_output)`` right after a unit's
gradient reduce-scatter, with this rank's reduced shard, before it divides (where it
divides afterwards) and copies the shard into the parameters' ``.grad``. The hook
(:class:`ReplicateAllReduce`, one per unit) all-reduces that shard in place over the
*replicate group*: the ranks that hold the same shard index in every replica, one per
node in the usual layout. Quantized, it is :func:`zcomm.all_reduce_q4` (INT4
reduce-scatter with fp32 sums, then an INT8 gather); otherwise the counted
:func:`zcomm.all_reduce`.

Division: every rank must end with the world mean ``sum / (S * R)`` over ``S`` shard ranks
and ``R`` replicas, as plain HSDP gives. FSDP2 divides by the shard group's size ``S``
alone (its reduce-scatter's AVG or ``PREMUL_SUM``, or a division around it for fp16
gradients and after ``set_force_sum_reduction_for_comms(True)``), since it sees only the
1-D mesh, so the hook averages over the ``R`` replicas. After
``set_gradient_divide_factor(f)`` FSDP2 divides by ``f`` and the hook sums, so that ``f`` is
the divisor of the whole reduction, as it is under FSDP2's own HSDP. The hook reads the
factor from the unit's FSDP2 state on every call, so it may be set before or after
:func:`zcomm.fsdp.enable_zeropp`. The quantized all-reduce divides in its fp32 reduction
and uses no NCCL reduction op, so FSDP2's sum-only setting needs nothing of it; the
unquantized one then sums and divides by ``R`` itself.

Streams: FSDP2 runs the hook on its all-reduce stream (on CUDA; on CPU there are no
streams and the hook just runs, blocking the backward for the cross-node reduction), after
that stream waited for the reduce-scatter, and reads ``reduce_output`` on the same stream
afterwards, so the hook works synchronously on the current stream.

[Note: reduce output on two streams] FSDP2 allocated ``reduce_output`` on its reduce-scatter
stream; the hook records it on the all-reduce stream, so that the allocator does not hand
its memory to the next unit's reduce-scatter while this all-reduce may still read or write it.

[Note: replicate state per unit] Each unit's hook keeps its own prepared all-reduces (one
per reduce-output numel, dtype, device and op, in a bounded cache, as the FSDP2 comms do)
and, with error feedback, one :class:`zcomm.ErrorFeedback` per numel, dtype and device:
error feedback follows one stream of reductions of one shape, here one unit's gradients.

What FSDP2 does around the hook: ``set_requires_gradient_sync(False)`` skips the
reduce-scatter and with it the hook (accumulate, then reduce once).

[Note: accumulation without the all-reduce] ``set_requires_all_reduce(False)`` (reduce-scatter
every micro-batch, all-reduce across replicas once) is honoured by the hook, since FSDP2
itself honours it only under its own HSDP: on the 1-D mesh it calls the hook on every
reduce-scatter and then accumulates ``reduce_output`` into ``.grad``. So the hook does what
FSDP2's HSDP does with its partial sum (:mod:`zcomm._fsdp_compat`): while the unit's flag is
off (:func:`~zcomm._fsdp_compat.requires_all_reduce`, read on every call) it adds
``reduce_output`` into the unit's ``partial`` (a copy of the first one) and zeroes
``reduce_output``, so FSDP2 adds zeros to ``.grad``; the first call with the flag on adds
``partial`` into ``reduce_output`` (the same additions, in the same order, as FSDP2's HSDP)
and all-reduces the sum once. The gradients then equal plain HSDP's doing the same
accumulation (bit for bit unquantized), and the cross-node traffic is one all-reduce per
unit per optimizer step. Two differences remain: during the accumulation ``.grad`` holds
zeros where plain HSDP leaves it untouched (None after ``zero_grad()``), and
``FSDPModule.reset_iter_state()``, which drops FSDP2's partial sums, does not reach the
hooks' (call :meth:`ReplicateAllReduce.discard_partial` on each of
:func:`zcomm.fsdp.all_reduce_hooks` then). A micro-batch whose backward gives gradients to
other parameters of the unit than the accumulated ones (a different ``reduce_output`` size)
raises ``RuntimeError``, as FSDP2's own sum does.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from ._device_guard import object_collective_device
from ._error_feedback import ErrorFeedback
from ._fsdp_compat import param_group, requires_all_reduce, shard_numels
from ._plan_cache import BoundedCache
from .all_reduce_q4 import gather_group_size_of, prepare_all_reduce_q4
from .plain_collectives import all_reduce
from .quant import SUPPORTED_DTYPES
from .topology import Topology

__all__ = ["ReplicateAllReduce", "check_replicate_group"]

# prepared all-reduces per hook: a unit's reduce output has one numel, dtype and device, and
# an op that changes only with set_gradient_divide_factor, so a few entries cover every step
_MAX_PREPARED = 4


class ReplicateAllReduce:
    """FSDP2's all-reduce hook of one unit: its reduce-scatter output reduced across the replicas.

    Args:
        unit: the ``FSDPModule`` whose hook this is (held weakly: the unit holds the hook).
        group: the replicate group; ``topology`` which of its ranks share a node.
        quantized: :func:`zcomm.all_reduce_q4` (else the counted :func:`zcomm.all_reduce`).
        group_size: elements per scale of both the INT4 reduction and the INT8 gather.
        first_hop_bits, hadamard_block: the reduction's (:func:`zcomm.reduce_scatter_q4`).
        gather_bits: the gather's width (``gather_bits`` of :func:`zcomm.all_reduce_q4`).
        error_feedback: LoCo state for the reduction's INT4 hops, per unit and shape.
        warn: called as ``warn(what, reason)`` when a call cannot be quantized.
    """

    def __init__(
        self,
        unit: nn.Module,
        group: dist.ProcessGroup,
        topology: Topology,
        *,
        quantized: bool,
        group_size: int | Literal["tensor"] | None,
        first_hop_bits: int,
        hadamard_block: int | None,
        gather_bits: int | None,
        error_feedback: bool,
        warn: Callable[[str, str], None],
    ) -> None:
        self._unit = weakref.ref(unit)
        self.group = group
        self.topology = topology
        self.quantized = quantized
        self._options = dict(group_size=group_size, gather_bits=gather_bits,
                             gather_group_size=gather_group_size_of(gather_bits, group_size), topology=topology,
                             first_hop_bits=first_hop_bits, hadamard_block=hadamard_block)  # fmt: skip
        self._error_feedback = error_feedback
        self.feedback: dict[tuple, ErrorFeedback] = {}  # (numel, dtype, device) -> its LoCo state
        self._warn = warn
        self._prepared = BoundedCache(_MAX_PREPARED)
        # the reduce outputs of the micro-batches not all-reduced yet, summed ([Note: accumulation without the all-reduce])
        self.partial: torch.Tensor | None = None

    def __call__(self, reduce_output: torch.Tensor) -> None:
        if reduce_output.is_cuda:  # [Note: reduce output on two streams]
            reduce_output.record_stream(torch.cuda.current_stream(reduce_output.device))
        unit = self._unit()
        if not requires_all_reduce(unit):
            self._accumulate(reduce_output)
            return
        if self.partial is not None:
            partial, self.partial = self.partial, None
            self._check_partial(partial, reduce_output)
            reduce_output += partial
        state = param_group(unit)
        divided = state.gradient_divide_factor is not None
        op = dist.ReduceOp.SUM if divided else dist.ReduceOp.AVG
        if self.quantized:
            if reduce_output.dtype in SUPPORTED_DTYPES:
                self._reduce_quantized(reduce_output, op, divided)
                return
            self._warn("gradient all-reduce across replicas", f"no quantized form: {reduce_output.dtype}")
        if divided or not state.force_sum_reduction_for_comms:
            all_reduce(reduce_output, op, self.group, topology=self.topology)
            return
        all_reduce(reduce_output, dist.ReduceOp.SUM, self.group, topology=self.topology)
        reduce_output.div_(self.topology.world_size)

    def discard_partial(self) -> None:
        """Drop the micro-batches accumulated without the all-reduce (after FSDP2's ``reset_iter_state``)."""
        self.partial = None

    def _accumulate(self, reduce_output: torch.Tensor) -> None:
        """A micro-batch under ``set_requires_all_reduce(False)``: its reduce output joins the
        partial sum and FSDP2 accumulates zeros ([Note: accumulation without the all-reduce])."""
        if self.partial is None:
            self.partial = reduce_output.clone()
        else:
            self._check_partial(self.partial, reduce_output)
            self.partial += reduce_output
        reduce_output.zero_()

    def _check_partial(self, partial: torch.Tensor, reduce_output: torch.Tensor) -> None:
        if partial.shape != reduce_output.shape or partial.dtype != reduce_output.dtype:
            raise RuntimeError(
                f"set_requires_all_reduce(False) accumulated reduce outputs of {partial.numel()} {partial.dtype} "
                f"elements, this micro-batch's has {reduce_output.numel()} {reduce_output.dtype}: the unit's backward "
                "gave gradients to other parameters than in the accumulated micro-batches (FSDP2's own HSDP fails "
                "alike)")

    def _reduce_quantized(self, reduce_output: torch.Tensor, op: dist.ReduceOp, divided: bool) -> None:
        shape = (reduce_output.numel(), reduce_output.dtype, reduce_output.device)
        prepared = self._prepared.get_or_make((*shape, divided), lambda: prepare_all_reduce_q4(
            reduce_output, op, self.group, with_error_feedback=self._error_feedback, **self._options))
        feedback = None
        if self._error_feedback:
            feedback = self.feedback.get(shape)
            if feedback is None:
                feedback = self.feedback[shape] = ErrorFeedback()
        prepared(reduce_output, error_feedback=feedback)


def check_replicate_group(
    units: Sequence[tuple[str, nn.Module, dist.ProcessGroup]], replicate_group: dist.ProcessGroup,
    device: torch.device | None = None,
) -> None:
    """Raise ``ValueError`` unless ``replicate_group`` pairs this rank with the ranks that hold
    the same shards of the same model: it meets each unit's shard group in this rank alone,
    and its members shard every unit alike (shard group size, shard index, the parameters'
    shard sizes). Collective on ``replicate_group`` (one exchange of those descriptions, on the
    parameters' ``device`` under NCCL: [Note: device guards] in :mod:`zcomm._device_guard`)."""
    if not isinstance(replicate_group, dist.ProcessGroup):
        raise TypeError(f"replicate_group must be a torch.distributed.ProcessGroup, got "
                        f"{type(replicate_group).__name__}")
    me = dist.get_rank()
    if dist.get_rank(replicate_group) < 0:
        raise ValueError("this rank is not a member of replicate_group: pass each rank the group of the ranks "
                         "holding its shard index in every replica")
    replicas = set(dist.get_process_group_ranks(replicate_group))
    mine = []
    for label, unit, shard_group in units:
        shared = replicas & set(dist.get_process_group_ranks(shard_group)) - {me}
        if shared:
            raise ValueError(
                f"replicate_group holds ranks {sorted(shared)} of the shard group of module {label!r}: it must hold "
                "one rank per replica, the one with this rank's shard index (e.g. DeviceMesh(..., (replicas, "
                "shards)).get_group('replicate'))")
        mine.append((label, dist.get_group_rank(shard_group, me), shard_group.size(), shard_numels(unit)))
    everyone: list[list | None] = [None] * replicate_group.size()
    with object_collective_device(replicate_group, device):
        dist.all_gather_object(everyone, mine, group=replicate_group)
    for peer, theirs in zip(dist.get_process_group_ranks(replicate_group), everyone, strict=True):
        if theirs == mine:
            continue
        ours, other = next(((a, b) for a, b in zip(mine, theirs, strict=False) if a != b), (mine, theirs))
        raise ValueError(
            f"rank {peer} of replicate_group shards the model otherwise than rank {me}: (module, shard index, "
            f"shard group size, parameter shard sizes) {other} there, {ours} here; replicate_group must pair "
            "ranks that hold the same shard of the same model")
