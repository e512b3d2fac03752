"""Quantized hierarchical all-reduce: qgZ's INT4 reduce-scatter, then qwZ's INT8 all-gather.

An all-reduce is a reduce-scatter followed by an all-gather. On ``W = N * L`` ranks
(``N`` nodes of ``L`` ranks, node-major) this module composes the two public collectives
over a flat view of the tensor of ``M`` elements, cut into ``W`` slices of ``m = ceil(M / W)``:

1. :func:`zcomm.reduce_scatter_q4` of the ``W * m`` elements: its first hop reduces inside the
   node on the fast links (INT4, or INT8 with ``first_hop_bits=8``), its second sends INT4
   node sums across nodes, and the sums are taken in fp32, so rank ``r`` ends with slice
   ``r`` reduced (divided by ``W`` for AVG) in the tensor's dtype;
2. :func:`zcomm.all_gather_q8` of those slices back into the tensor: each slice crosses the
   nodes once as blocked INT8, then the node-local gather. ``gather_bits=4`` sends each slice
   as blocked INT4 instead (its quantization, then :func:`zcomm.all_gather_hierarchical` of the
   bytes, inter-node first, then one dequantization of every slice); ``gather_bits=None``
   gathers with the plain :func:`zcomm.all_gather_into_tensor`, unquantized, on a flat ring.

Every rank dequantizes every slice, its own included, from the same payload, so every rank
ends with the same bits, as ``dist.all_reduce`` guarantees (a DDP replica must not drift).

Bytes (the comm_stats model; ``P_b(n)`` is the payload of ``n`` elements at ``b`` bits with
its fp32 scales): each rank sends ``(N-1) (P_4(m) + P_8(m))``, about ``1.5 (N-1) m`` bytes,
across nodes, so a node's uplink carries about ``1.5 L (N-1) m`` where a bf16 ring
all-reduce in rank order makes the node's boundary rank send ``4 (W-1) m``: 0.25x on 2 nodes x
2 ranks, 0.2x on 2 x 8. ``gather_bits=4`` sends ``(N-1) (P_4(m) + P_4(m))``, about ``1.06 (N-1)
m`` bytes: 0.18x on 2 x 2, 0.14x on 2 x 8. ``gather_bits=None`` gathers in the tensor's dtype
on a flat ring (``2 (W-1) m`` bytes in bf16 from the boundary rank). An all_reduce_q4 call
shows up in :func:`zcomm.comm_stats` as one ``reduce_scatter_q4`` call and one
``all_gather_q8`` (``all_gather_hierarchical`` with ``gather_bits=4``, ``all_gather_into_tensor``
with None) call, with those collectives' own byte figures.

Error (per element ``j`` in slice ``r``; ``d`` the divisor, 1 for SUM and ``W`` for AVG):
``|out_j - exact_j| <= R_j + G_j`` where

* ``R_j`` is :func:`zcomm.reduce_scatter_q4`'s bound on rank ``r``: the sum over the ``W``
  sources of half their first-hop group scale (``absmax / 7 / 2``, or ``/ 127 / 2`` with
  ``first_hop_bits=8``), plus over the ``N`` nodes half the INT4 group scale of that node's
  fp32 partial sum, all divided by ``d``, then fp32 sums and one rounding to the dtype;
* ``G_j`` is the gather's: half the INT8 group scale of the reduced slice (``absmax / 127 /
  2`` over the ``gather_group_size`` elements of ``j``'s group; ``absmax / 7 / 2`` with
  ``gather_bits=4``), then one more rounding to the dtype (``G_j = 0`` with ``gather_bits=None``).

So the INT8 gather's term is at most ``1/254`` of the largest reduced value of the group, a
little over a third of the INT4 hops' single-source term; the INT4 gather's is ``1/14`` of it,
18 times more, for half the gather's bytes. tests/collective_oracles.py derives the bound from
the wire format and tests/collectives/test_all_reduce_q4.py checks it against fp64.

Padding: when ``W`` does not divide ``M`` the tensor is copied into a zero-padded buffer of
``W * m`` elements and the result copied back (``W - 1`` elements of padding at most); when
it does, the reduce-scatter reads the tensor and the gather writes it, with no copy.

[Note: all-reduce async] The two collectives are of different kinds (their own private
groups, workers and side streams: [Note: kinds] in :mod:`zcomm._contract`), so the gather
cannot be issued up front: on CPU its worker would run it before the reduction delivered.
``async_op=True`` therefore issues the reduce-scatter now and, on CPU, the gather when the
handle's ``wait()`` runs, in the caller's program order (the same on every rank, as the
gathers' ordering needs); the reduce-scatter, the larger part, overlaps the caller's work,
and ``is_completed()`` stays False until ``wait()``. On CUDA both are enqueued at once, on a
side stream of this module that waits for the current stream; ``wait()`` makes the current
stream wait for its end, as for the other collectives ([Note: CUDA streams] in
:mod:`zcomm._chain_runner`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.distributed as dist

from ._chain_runner import SideStream
from ._contract import Handle
from ._error_feedback import ErrorFeedback
from .all_gather_q8 import PreparedAllGatherQ8, all_gather_q8, prepare_all_gather_q8
from .hierarchical_gather import all_gather_hierarchical
from .plain_collectives import all_gather_into_tensor
from .quant import SUPPORTED_DTYPES, QuantSpec, dequantize, quantize
from .quant._plain import PLAIN_TENSORS
from .reduce_scatter_q4 import PreparedReduceScatterQ4, prepare_reduce_scatter_q4_coalesced, reduce_scatter_q4
from .topology import Topology

__all__ = ["PreparedAllReduceQ4", "all_reduce_q4", "prepare_all_reduce_q4"]

GatherBits = Literal[4, 8] | None
# reduce(output, input, async_op) and gather(output, input), both forms' steps 1 and 2
_Reduce = Callable[[torch.Tensor, torch.Tensor, bool], Handle | None]
_Gather = Callable[[torch.Tensor, torch.Tensor], None]


def all_reduce_q4(
    tensor: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.AVG,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    group_size: int | Literal["tensor"] | None = None,
    gather_bits: GatherBits = 8,
    gather_group_size: int | Literal["tensor"] | None = None,
    pipeline_stages: int | None = None,
    topology: Topology | None = None,
    error_feedback: ErrorFeedback | None = None,
    first_hop_bits: int = 4,
    hadamard_block: int | None = None,
) -> Handle | None:
    """Quantized hierarchical drop-in for ``torch.distributed.all_reduce`` (in place), see the module docstring.

    Args:
        tensor: contiguous fp32/bf16/fp16, any shape and numel; reduced in place.
        op: ``ReduceOp.AVG`` (the default: what data parallelism wants; divides by the group
            size in the fp32 reduction), ``ReduceOp.SUM`` or ``ReduceOp.PREMUL_SUM(c)``
            (:func:`zcomm.reduce_scatter_q4`'s).
        group: the process group (default: world).
        async_op: return a :class:`zcomm.Handle`; ``tensor`` is valid after its ``wait()``
            ([Note: all-reduce async]).
        group_size: elements per INT4 scale of the reduce-scatter (its ``group_size``).
        gather_bits: 8 (the reduced slices gathered as blocked INT8 by :func:`zcomm.all_gather_q8`),
            4 (blocked INT4 through :func:`zcomm.all_gather_hierarchical`: half the gather's
            bytes, 18 times its error bound) or None (gathered unquantized by
            :func:`zcomm.all_gather_into_tensor`: the reduce-scatter's error only, for twice
            the INT8 gather's bytes in bf16).
        gather_group_size: elements per scale of the quantized gather (its ``group_size``).
        pipeline_stages: the reduce-scatter's (default :func:`zcomm.reduce_scatter_q4.default_pipeline_stages`);
            the gather pipelines by its own default.
        topology: which ranks share a node (default: detected).
        error_feedback: LoCo state of the reduce-scatter's INT4 hops (:class:`zcomm.ErrorFeedback`,
            one per stream of all-reduces of one shape, e.g. one gradient bucket); the gather's
            INT8 rounding is not fed back.
        first_hop_bits, hadamard_block: the reduce-scatter's (:func:`zcomm.reduce_scatter_q4`).
    """
    group, world = _check_call(tensor, op, group, gather_bits, gather_group_size)
    reduce = _reduce_step(op, group, group_size=group_size, pipeline_stages=pipeline_stages, topology=topology,
                          error_feedback=error_feedback, first_hop_bits=first_hop_bits, hadamard_block=hadamard_block)
    gather = _gather_step(group, gather_bits, gather_group_size, topology)
    return _all_reduce(tensor, world, reduce, gather, async_op)


class PreparedAllReduceQ4:
    """:func:`all_reduce_q4` resolved once for one tensor shape (:func:`prepare_all_reduce_q4`).

    It holds the prepared reduce-scatter and gather of the padded flat view ([Note: prepared
    calls] in :mod:`zcomm.reduce_scatter_q4`); each call checks that ``tensor`` is a plain
    contiguous tensor of the prepared numel, dtype and device (``ValueError`` otherwise) and
    that error feedback is passed exactly when it was prepared with it.
    """

    __slots__ = ("_world", "_signature", "_reduce", "_gather", "_with_feedback")

    def __init__(self, world: int, signature: tuple, reduce: PreparedReduceScatterQ4,
                 gather: PreparedAllGatherQ8 | _Gather, with_feedback: bool) -> None:
        self._world, self._signature, self._reduce, self._gather = world, signature, reduce, gather
        self._with_feedback = with_feedback

    def __call__(self, tensor: torch.Tensor, *, async_op: bool = False,
                 error_feedback: ErrorFeedback | None = None) -> Handle | None:
        """:func:`all_reduce_q4` of ``tensor`` as prepared."""
        if (type(tensor) not in PLAIN_TENSORS or not tensor.is_contiguous()
                or (tensor.numel(), tensor.dtype, tensor.device) != self._signature):
            raise ValueError("a prepared all_reduce_q4 got a tensor of another numel, dtype or device (or not a plain "
                             "contiguous tensor) than it was prepared for: prepare another one")
        if (error_feedback is not None) != self._with_feedback:
            raise ValueError(f"this prepared all_reduce_q4 was prepared {'with' if self._with_feedback else 'without'}"
                             " error feedback")
        prepared = self._reduce

        def reduce(output: torch.Tensor, input: torch.Tensor, run_async: bool) -> Handle | None:
            return prepared([output], [input], async_op=run_async, error_feedback=error_feedback)

        return _all_reduce(tensor, self._world, reduce, _gather_call(self._gather), async_op)


def prepare_all_reduce_q4(
    tensor: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.AVG,
    group: dist.ProcessGroup | None = None,
    *,
    group_size: int | Literal["tensor"] | None = None,
    gather_bits: GatherBits = 8,
    gather_group_size: int | Literal["tensor"] | None = None,
    pipeline_stages: int | None = None,
    topology: Topology | None = None,
    with_error_feedback: bool = False,
    first_hop_bits: int = 4,
    hadamard_block: int | None = None,
) -> PreparedAllReduceQ4:
    """A :class:`PreparedAllReduceQ4` for calls on tensors like ``tensor`` (same numel, dtype and
    device), with the arguments of :func:`all_reduce_q4`; ``with_error_feedback`` says whether
    every call passes an :class:`ErrorFeedback`. Raises what the collective would raise. Preparing
    may create zcomm's private subgroups (a collective step): every rank prepares at the same
    point of its sequence of collectives. ``tensor`` is only looked at, never communicated.
    """
    group, world = _check_call(tensor, op, group, gather_bits, gather_group_size)
    slice_numel = -(-tensor.numel() // world)
    padded = torch.empty(world * slice_numel, dtype=tensor.dtype, device=tensor.device)
    reduced = torch.empty(slice_numel, dtype=tensor.dtype, device=tensor.device)
    reduce = prepare_reduce_scatter_q4_coalesced(
        [reduced], [padded], op, group, group_size=group_size, pipeline_stages=pipeline_stages, topology=topology,
        with_error_feedback=with_error_feedback, first_hop_bits=first_hop_bits, hadamard_block=hadamard_block)
    if gather_bits == 8:
        gather: PreparedAllGatherQ8 | _Gather = prepare_all_gather_q8(padded, reduced, group,
                                                                      group_size=gather_group_size, topology=topology)
    else:
        gather = _gather_step(group, gather_bits, gather_group_size, topology)
    return PreparedAllReduceQ4(world, (tensor.numel(), tensor.dtype, tensor.device), reduce, gather,
                               with_error_feedback)


def gather_group_size_of(gather_bits: GatherBits, group_size: int | Literal["tensor"] | None
                         ) -> int | Literal["tensor"] | None:
    """The gather's group size for callers with one ``group_size`` for both halves: the
    reduction's, or None when the gather is exact."""
    return None if gather_bits is None else group_size


def check_gather(gather_bits: GatherBits, gather_group_size: int | Literal["tensor"] | None) -> None:
    """``gather_bits`` is 4, 8 or None, and ``gather_group_size`` a group size of that quantized
    gather (None without one): the gather's options, checked once for the collective and for
    :class:`zcomm.ddp.QuantizedAllReduceState`."""
    if gather_bits is not None and (isinstance(gather_bits, bool) or gather_bits not in (4, 8)):
        raise ValueError(f"gather_bits must be 4, 8 or None, got {gather_bits!r}")
    if gather_bits is None and gather_group_size is not None:
        raise ValueError("gather_group_size applies to a quantized gather: pass it with gather_bits 4 or 8 only")
    QuantSpec(bits=gather_bits or 8, group_size=gather_group_size)


def _check_call(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None, gather_bits: GatherBits,
                gather_group_size: int | Literal["tensor"] | None) -> tuple[dist.ProcessGroup, int]:
    """The group (default: world) and its size once the arguments only this module reads are
    checked; the collectives check the rest (options, topology) themselves."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"tensor has dtype {tensor.dtype}; supported: fp32, bf16, fp16")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous")
    if not (op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM):
        raise ValueError(f"op must be ReduceOp.SUM, ReduceOp.AVG or ReduceOp.PREMUL_SUM(factor), got {op}")
    check_gather(gather_bits, gather_group_size)
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if world < 1:
        raise ValueError("this rank is not a member of the given group")
    return group, world


def _reduce_step(op: dist.ReduceOp, group: dist.ProcessGroup, **options) -> _Reduce:
    def reduce(output: torch.Tensor, input: torch.Tensor, run_async: bool) -> Handle | None:
        return reduce_scatter_q4(output, input, op, group, run_async, **options)
    return reduce


def _gather_step(group: dist.ProcessGroup, gather_bits: GatherBits, group_size: int | Literal["tensor"] | None,
                 topology: Topology | None) -> _Gather:
    if gather_bits == 8:
        def gather(output: torch.Tensor, input: torch.Tensor) -> None:
            all_gather_q8(output, input, group, group_size=group_size, topology=topology)
    elif gather_bits == 4:
        spec = QuantSpec(bits=4, group_size=group_size)

        def gather(output: torch.Tensor, input: torch.Tensor) -> None:
            _gather_int4(output, input, group, spec, topology)
    else:
        def gather(output: torch.Tensor, input: torch.Tensor) -> None:
            all_gather_into_tensor(output, input, group, topology=topology)
    return gather


def _gather_int4(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, spec: QuantSpec,
                 topology: Topology | None) -> None:
    """Step 2 with ``gather_bits=4``: every rank's slice ``input`` as blocked INT4 (groups restart
    at each slice's start), gathered as bytes and dequantized, every slice from the same
    payload on every rank, so every rank ends with the same bits."""
    numel = input.numel()
    group_size = spec.group_size_for(numel)
    payload = quantize(input, 4, group_size)
    received = torch.empty(output.numel() // max(numel, 1) * payload.numel(), dtype=torch.uint8, device=input.device)
    all_gather_hierarchical(received, payload, group, topology=topology)
    if numel:
        dequantize(received.view(-1, payload.numel()), numel, 4, group_size, output.dtype, out=output)


def _gather_call(gather: PreparedAllGatherQ8 | _Gather) -> _Gather:
    if isinstance(gather, PreparedAllGatherQ8):
        return lambda output, input: gather(output, input)
    return gather


def _all_reduce(tensor: torch.Tensor, world: int, reduce: _Reduce, gather: _Gather, async_op: bool) -> Handle | None:
    """Steps 1 and 2 of the module docstring on ``tensor``'s padded flat view."""
    flat = tensor.detach().view(-1)
    numel = flat.numel()
    slice_numel = -(-numel // world)
    padded = flat if world * slice_numel == numel else _padded_copy(flat, world * slice_numel)
    reduced = torch.empty(slice_numel, dtype=flat.dtype, device=flat.device)

    def finish() -> None:
        gather(padded, reduced)
        if padded is not flat:
            flat.copy_(padded[:numel])

    if flat.is_cuda and async_op:
        def chain() -> None:
            reduce(reduced, padded, False)
            finish()
        return _side_stream(flat.device).run(chain, (flat, padded, reduced))
    handle = reduce(reduced, padded, async_op)
    if not async_op:
        finish()
        return None
    finished: list[bool] = []

    def wait_then_gather() -> None:  # [Note: all-reduce async]
        handle.wait()
        finish()
        finished.append(True)

    return Handle(finish=wait_then_gather, ready=lambda: bool(finished))


def _padded_copy(flat: torch.Tensor, numel: int) -> torch.Tensor:
    padded = torch.empty(numel, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()].copy_(flat)
    padded[flat.numel():].zero_()
    return padded


# device -> this module's side stream for async CUDA calls ([Note: all-reduce async]); one per device
_SIDE_STREAMS: dict[torch.device, SideStream] = {}


def _side_stream(device: torch.device) -> SideStream:
    side = _SIDE_STREAMS.get(device)
    if side is None:
        side = _SIDE_STREAMS.setdefault(device, SideStream(device))
    return side
