"""qgZ: hierarchical 2-hop INT4 reduce-scatter (ZeRO++ sections 3.3 and 4, Algorithm 2).

On ``W = N * L`` ranks (``N`` nodes of ``L`` ranks, node-major), for each of ``k``
pipeline stages:

1. (once, fused for all stages) reorder the input's sub-slices
   (:mod:`zcomm._slice_reorder`) and quantize them to INT4 rows, one per intra-node peer
   and stage, reading the input where it is (one kernel, no copy);
2. intra-node all-to-all of stage ``s``'s ``L`` rows on zcomm's private intra-node group;
3. dequantize the ``L`` received rows, sum them in fp32 and re-quantize the node's sum to
   INT4 as ``N`` rows, one per node, in one fused op;
4. inter-node all-to-all of those rows among the ``N`` ranks with this local rank;
5. dequantize the ``N`` node sums, add them in fp32 (dividing by ``W`` for AVG) and write
   them straight into part ``s`` of ``output``: the reordering made this rank's slice
   arrive in place.

AVG is folded into step 5: the fp32 sum is divided by ``W`` in fp32 and rounded to the
output dtype once, in the same pass, so ``op=AVG`` costs nothing over SUM.

[Note: PREMUL_SUM as a division] ``ReduceOp.PREMUL_SUM(c)`` (what FSDP2 passes after
``set_gradient_divide_factor(f)``, with ``c = fl64(1/f)``) is folded the same way, as a
division by ``d = 1/c`` (a double) in fp32: the result is ``fl32(S / fl32(d))`` for the fp32
sum ``S``, rounded once to the output dtype. For an integer ``f <= 2**24``, ``d`` is within a
double ulp of ``f``, so ``fl32(d) == f`` exactly and PREMUL_SUM(1/f) gives AVG's bits over
``f``; for any other ``c``, ``fl32(d)`` is within 2**-24 (relative) of ``1/c``, so the result
is within about 2**-23 of ``S * c`` before the final rounding. Multiplying each input by
``c`` first (NCCL's PreMulSum) would instead round every scaled input. Callers that
want the mean should ask for AVG rather than SUM and a division of their own, which is an
extra pass over the output and a second rounding (in bf16: up to half a bf16 ulp more
error per element).

The intra hop of stage ``s+1`` runs while the inter hop of stage ``s`` is in flight (all
intra hops are issued up front on one group, each inter hop as soon as its stage is
reduced). One node: step 2 is the only all-to-all and step 3 writes ``output``. One rank
per node: steps 2-3 are skipped.

Error: each INT4 quantization moves an element by at most half its group's scale
(``absmax / 7 / 2``), so an output element is off by at most the sum, over the ``W``
sources, of their hop-1 half-scales plus, over the ``N`` nodes, the hop-2 half-scale of
that node's partial sum (then fp32 and output-dtype rounding).

Padding: each rank's slice of ``m = output.numel()`` elements is cut into ``k`` parts of
``q = ceil(m / k)``; when ``k * q != m`` each slice is read as if zero-filled to ``k * q``
elements: step 1 reads the zeros from nowhere ([Note: interleaved input] in
:mod:`zcomm.quant._contract`), so there is no staging copy of the input, and only the last
stage's part goes through a ``q``-element buffer on its way into ``output``. Any ``numel``
works and the collective is never swapped for an unquantized one.

[Note: qgZ direct kernels] The chain calls the plan's ``reorder_quantize``,
``dequant_reduce`` and ``dequant_reduce_requant`` kernels directly, not the public ops, into
buffers of the sizes the plan computed: the plan ([Note: one plan per call] in
:mod:`zcomm._plan`) checked the tensors and the options once, resolved the spec, the
permutation, the row sizes and the backend (``$ZCOMM_BACKEND`` when the plan was made, then
the device), and planned each kernel for the calls the chain makes ([Note: planned kernels]
in :mod:`zcomm.quant._contract`: on CUDA every launch is resolved then, before the first
hop). So the public ops' checks, backend choice and dispatch are not repeated per call and
per stage, and nothing is compiled between hops. Error feedback's steps use the same planned
kernels (and the plan's ``quantize`` and ``dequantize`` for its stored errors: [Note:
feedback kernels] in :mod:`zcomm._error_feedback`). The kernels get the contract's arguments
exactly.

[Note: an INT8 first hop] ``first_hop_bits=8`` (after SDP4Bit's two-level scheme, arXiv
2410.15526: 8 bits inside the node, 4 across) quantizes step 1 to INT8 and makes step 3 read
INT8 rows, sum them in fp32 and re-quantize the node's sum to INT4 as before, in the same
one-pass kernel (``dequant_reduce(requant_bits=4)``: the fp32 sum never goes to memory), so
the bytes that cross nodes are unchanged and only the intra-node hop, on the fast links,
doubles. Hop
1's error bound shrinks 18x (``absmax / 127 / 2`` per group instead of ``absmax / 7 / 2``),
leaving hop 2's as the main term. With one node every byte is intra-node, so the single hop
is INT8; with one rank per node there is no intra hop and step 1 stays INT4 (its rows cross
nodes). Not combined with error feedback (its stored errors model INT4 hops).

Error feedback (LoCo, :class:`zcomm.ErrorFeedback`, opt-in per call): steps 1 and 3
quantize the values plus the error the same stream left behind, then update that error
(see :mod:`zcomm._error_feedback`). Step 1 then reads the reordered input chunk by chunk
into fp32 scratch of a fraction of its size ([Note: feedback in chunks]), the fp32 error
itself being the one buffer of the input's size, and step 3 sums in fp32 before it
re-quantizes; rows, groups and bytes on the wire are those of the path without feedback.

Coalesced (:func:`reduce_scatter_q4_coalesced`, after
``torch.distributed.reduce_scatter_tensor_coalesced``): ``T`` pairs reduced as one
collective, the flat form's result on the inputs interleaved rank by rank
(``[in_0 slice r, in_1 slice r, ...]`` is the virtual input's slice ``r``), with the same
bytes on the wire and in every output. Step 1 reads the inputs where they are, so a bucket
of gradients needs no ``torch.cat``; outputs that lie end to end in one buffer (the pieces
of ``flat.split(sizes)``) are written in place, others through one buffer of this rank's
``m`` elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Literal

import torch
import torch.distributed as dist

from . import quant
from ._chain_runner import chain_worker, run_chain
from ._contract import GroupInfo, Handle
from ._error_feedback import _STORE_BITS, ErrorFeedback, _identity, chunk_row_counts, reordered_view
from ._groups import NodeGroups, node_groups
from ._hadamard import check_hadamard_block, rotate_back_, rotated_input
from ._hop_release import start_hop
from ._pipeline import MAX_DEFAULT_STAGES, STAGE_BYTES, check_stages, default_stages
from ._plan import Plan, check_plannable, find_plan, keep_plan, plan_kernels
from ._prologue import coalesced_key, prologue, prologue_coalesced
from ._slice_reorder import first_hop_rows, reorder_permutation
from .comm_stats import stats_row
from .quant._contract import dequantize_use, quantize_use, reorder_use, requant_use
from .quant._plain import PLAIN_TENSORS
from .topology import Topology

__all__ = [
    "MAX_DEFAULT_STAGES", "STAGE_BYTES", "check_first_hop_bits", "check_hadamard_block", "default_pipeline_stages",
    "PreparedReduceScatterQ4", "prepare_reduce_scatter_q4_coalesced", "reduce_scatter_q4", "reduce_scatter_q4_coalesced",
]

_BITS = 4


class ReducePlan(Plan):
    """qgZ's plan ([Note: one plan per call] in :mod:`zcomm._plan`): what :class:`~zcomm._plan.Plan`
    holds, and the stages, the slice order and the rows' sizes."""

    __slots__ = ("groups", "stages", "part", "group_size", "first_bits", "perm", "num_rows", "row_nbytes",
                 "requant_nbytes", "hadamard_block", "feedback_geometry")

    groups: NodeGroups
    stages: int
    part: int  # q: elements of each stage's part of one slice
    group_size: int  # concrete: "tensor" resolved for the longest payload row
    first_bits: int  # bits of step 1's rows (see [Note: an INT8 first hop])
    perm: tuple[int, ...]  # step 1's slice order (zcomm._slice_reorder)
    num_rows: int  # step 1's payload rows
    row_nbytes: int  # bytes of one of step 1's payload rows
    requant_nbytes: int  # bytes of one of step 3's re-quantized rows
    hadamard_block: int | None  # see [Note: Hadamard smoothing] in zcomm._hadamard
    feedback_geometry: tuple[int, ...]  # what an ErrorFeedback is bound to


def default_pipeline_stages(input_nbytes: int, slice_numel: int, topology: Topology) -> int:
    """The ``pipeline_stages`` used when none is given: one per :data:`STAGE_BYTES` of input, at
    most :data:`MAX_DEFAULT_STAGES` and at most one per element of a slice, and only with two hops."""
    return default_stages(input_nbytes, slice_numel, topology)


def reduce_scatter_q4(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    group_size: int | Literal["tensor"] | None = None,
    pipeline_stages: int | None = None,
    topology: Topology | None = None,
    error_feedback: ErrorFeedback | None = None,
    first_hop_bits: int = 4,
    hadamard_block: int | None = None,
) -> Handle | None:
    """INT4 2-hop drop-in for ``torch.distributed.reduce_scatter_tensor`` with ``op`` SUM, AVG or PREMUL_SUM.

    Args:
        output: contiguous, ``input.numel() / world_size`` elements, same dtype (fp32/bf16/fp16) and device.
        input: contiguous; slice ``r`` (``[r*m, (r+1)*m)``) is reduced onto rank ``r``.
        op: ``ReduceOp.SUM``, ``ReduceOp.AVG`` (divides by the whole group size in the
            final fp32 reduction: prefer it to SUM and a division of your own) or
            ``ReduceOp.PREMUL_SUM(c)`` for a positive Python float ``c`` (the sum times ``c``,
            as a division by ``1/c`` in the same reduction: [Note: PREMUL_SUM as a division]).
        group: the process group (default: world).
        async_op: return a :class:`zcomm.Handle`; ``output`` is valid after its ``wait()``.
        group_size: elements per INT4 scale: an even int >= 2, ``"tensor"`` (one scale per
            payload row, ZeRO++'s non-blocked ablation) or None (INT4's default,
            ``zcomm.quant.DEFAULT_GROUP_SIZE[4]``); see :class:`zcomm.quant.QuantSpec`.
        pipeline_stages: chunks overlapping intra- and inter-node hops (default
            :func:`default_pipeline_stages`).
        topology: which ranks share a node (default: :meth:`Topology.detect`, run once per group
            and call shape, when its plan is made: [Note: one plan per call] in :mod:`zcomm._plan`).
        error_feedback: LoCo state of the stream of reductions this call belongs to (None:
            stateless); see :class:`zcomm.ErrorFeedback`.
        first_hop_bits: 4 (ZeRO++) or 8: the intra-node hop in INT8, the inter-node hop
            still INT4 ([Note: an INT8 first hop]).
        hadamard_block: None, or a power of two: rotate every block of this many elements of
            each slice by an orthonormal Hadamard matrix before quantizing and rotate the
            output back, spreading outliers over their block (SDP4Bit's smoothing; [Note:
            Hadamard smoothing] in ``zcomm._hadamard``). Same bytes on the wire; costs an fp32
            copy of the input and ``log2(block)`` passes over it. Not with ``error_feedback``.
    """
    group = group if group is not None else dist.group.WORLD
    if error_feedback is not None:
        _check_feedback(error_feedback)
    options = _options(group_size, pipeline_stages, first_hop_bits, hadamard_block, error_feedback is not None)
    plan = None
    if type(output) in PLAIN_TENSORS and type(input) in PLAIN_TENSORS and output.is_contiguous() and input.is_contiguous():
        plan = find_plan(group, _key(output, input, topology, options))
    if plan is None:
        plan = _plan_of_call(group, [output], [input], topology, options, coalesced=False)
    return _run(plan, _divisor(op, plan.info.world_size), error_feedback, [output], [input], async_op)


def reduce_scatter_q4_coalesced(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    group_size: int | Literal["tensor"] | None = None,
    pipeline_stages: int | None = None,
    topology: Topology | None = None,
    error_feedback: ErrorFeedback | None = None,
    first_hop_bits: int = 4,
    hadamard_block: int | None = None,
) -> Handle | None:
    """:func:`reduce_scatter_q4` of several tensors as one collective, after
    ``torch.distributed.reduce_scatter_tensor_coalesced``: ``outputs[i]`` receives this
    rank's slice of ``inputs[i]`` reduced over the group.

    The result is that of :func:`reduce_scatter_q4` on the inputs interleaved rank by rank
    (its slice ``r`` is every input's slice ``r`` in list order) scattered into the outputs,
    byte for byte, without building that interleaving: quantization groups and pipeline
    stages run across tensor boundaries exactly as in the flat form.

    Args:
        outputs: contiguous, ``outputs[i].numel() == inputs[i].numel() / world_size``; all
            tensors of both lists share one dtype (fp32/bf16/fp16) and device. Outputs that
            lie end to end in one buffer (``flat.split(sizes)``) are written in place.
        inputs: contiguous; read where they are, never copied.
        op, group, async_op, group_size, pipeline_stages, topology, error_feedback, first_hop_bits, hadamard_block:
            as for :func:`reduce_scatter_q4`, for the whole bucket (``pipeline_stages`` and the
            default stage count apply to the interleaved input, ``"tensor"`` to its rows).
    """
    group = group if group is not None else dist.group.WORLD
    if error_feedback is not None:
        _check_feedback(error_feedback)
    options = _options(group_size, pipeline_stages, first_hop_bits, hadamard_block, error_feedback is not None)
    key = coalesced_key(outputs, inputs, False, topology)
    plan = None if key is None else find_plan(group, (key, options))
    if plan is None:
        plan = _plan_of_call(group, outputs, inputs, topology, options, coalesced=True)
    return _run(plan, _divisor(op, plan.info.world_size), error_feedback, list(outputs), list(inputs), async_op)


def _check_feedback(feedback: ErrorFeedback | None) -> None:
    if feedback is not None and type(feedback) is not ErrorFeedback and not isinstance(feedback, ErrorFeedback):
        raise TypeError(f"error_feedback must be a zcomm.ErrorFeedback or None, got {type(feedback).__name__}")


def _options(group_size: int | Literal["tensor"] | None, pipeline_stages: int | None, first_hop_bits: int,
             hadamard_block: int | None, with_feedback: bool) -> tuple:
    """A call's options in its plan key: each with its type (and whether there is error feedback),
    so a call with an invalid option never finds a plan and reaches the check."""
    return (type(group_size), group_size, type(pipeline_stages), pipeline_stages, type(first_hop_bits), first_hop_bits,
            type(hadamard_block), hadamard_block, with_feedback)


def _key(output: torch.Tensor, input: torch.Tensor, topology: Topology | None, options: tuple) -> tuple:
    """The plan key of a call of the flat form ([Note: one plan per call] in :mod:`zcomm._plan`);
    the coalesced form's is ``(coalesced_key(...), options)``."""
    return ("reduce_scatter_q4", topology, output.numel(), input.numel(), output.dtype, input.dtype, output.device,
            input.device, options)


def _plan_of_call(group: dist.ProcessGroup, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                  topology: Topology | None, options: tuple, *, coalesced: bool) -> ReducePlan:
    """The plan of a call that did not find one by its key: the tensors checked (the prologue raises
    for the exact reason), then the plan of their key, found or made (the options checked) and kept
    ([Note: one plan per call] in :mod:`zcomm._plan`).

    ``options`` holds each option with its type (and whether there is error feedback), so a call
    with an invalid option never finds a plan and reaches the check.
    """
    first = inputs[0] if isinstance(inputs, Sequence) and inputs else None
    if isinstance(first, torch.Tensor):
        check_plannable(first.device, "reduce_scatter_q4")
    if coalesced:
        info = prologue_coalesced(outputs, inputs, group, topology, gather=False)
        key = coalesced_key(outputs, inputs, False, topology)
        key = None if key is None else (key, options)
    else:
        output, input = outputs[0], inputs[0]
        info = prologue(output, input, group, topology, gather=False, quantized=True)
        key = _key(output, input, topology, options)
    plan = find_plan(group, key)
    if plan is None:
        group_size, pipeline_stages, first_hop_bits, hadamard_block = options[1:8:2]
        plan = keep_plan(group, key, _make_plan(group, info, list(outputs), list(inputs), group_size, pipeline_stages,
                                                first_hop_bits, hadamard_block, options[-1]))
    return plan


def _run(plan: ReducePlan, divide_by: float, feedback: ErrorFeedback | None, outputs: Sequence[torch.Tensor],
         inputs: Sequence[torch.Tensor], async_op: bool) -> Handle | None:
    """Run the planned collective on checked tensors: count it, then hand its chain to the runner."""
    if feedback is not None:
        feedback.bind(plan.feedback_geometry)
    plan.stats.add(*plan.bytes_sent)
    if plan.stages * plan.part == 0:
        return Handle(finish=lambda: None, ready=lambda: True) if async_op else None
    flat = [input if input.dim() == 1 else input.view(-1) for input in inputs]
    chain = partial(_chain, plan, divide_by, feedback, outputs, flat)
    return run_chain(chain, (*outputs, *inputs), async_op, plan.worker)


class PreparedReduceScatterQ4:
    """:func:`reduce_scatter_q4_coalesced` resolved once for one bucket's tensors
    (:func:`prepare_reduce_scatter_q4_coalesced`), called with that bucket's tensors each time.

    [Note: prepared calls] A caller that reduces the same bucket over and over (the ZeRO
    runtime: one per gradient bucket) holds this object instead of calling the collective.
    Preparing runs everything the collective does before its chain once: the prologue's
    group resolution and tensor checks, the op's divisor, the options' checks and the plan.
    What that depends on is fixed by the contract: the same group (held here: the caller owns
    the object and the object its group, so the group, its private subgroups and its worker
    live as long as the object; [Note: plan cache lifetime] in :mod:`zcomm._plan_cache`),
    topology, op and options, and tensors of the same count,
    sizes, dtype and device, plain and contiguous. Each call revalidates only the tensors,
    cheaply: one pass building the key the collective's plan lookup would build
    (:func:`zcomm._prologue.coalesced_key`), compared with the prepared one, ``ValueError``
    when it differs (never a silent re-plan: the contract was broken), and the error feedback's
    presence and geometry (the state object may be replaced, e.g. by a checkpoint load). The
    tensors' addresses are read by the chain of each call, so new buffers of the same shapes
    are fine. What is not rechecked: the group, topology, op and options, which the object
    holds and the caller cannot change.
    """

    __slots__ = ("_plan", "_group", "_divide_by", "_key", "_with_feedback")

    def __init__(self, plan: ReducePlan, group: dist.ProcessGroup, divide_by: float, key: tuple,
                 with_feedback: bool) -> None:
        self._plan, self._group, self._divide_by, self._key = plan, group, divide_by, key
        self._with_feedback = with_feedback

    def __call__(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *, async_op: bool = False,
                 error_feedback: ErrorFeedback | None = None) -> Handle | None:
        """:func:`reduce_scatter_q4_coalesced` of ``outputs`` and ``inputs`` as prepared."""
        if coalesced_key(outputs, inputs, False, self._key[2]) != self._key:
            raise ValueError("a prepared reduce_scatter_q4 got tensors of other sizes, dtypes or devices (or not "
                             "plain contiguous tensors) than it was prepared for: prepare another one")
        if (error_feedback is not None) != self._with_feedback:
            raise ValueError(f"this prepared reduce_scatter_q4 was prepared {'with' if self._with_feedback else 'without'}"
                             " error feedback")
        if error_feedback is not None:
            _check_feedback(error_feedback)
        return _run(self._plan, self._divide_by, error_feedback, outputs, inputs, async_op)


def prepare_reduce_scatter_q4_coalesced(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    *,
    group_size: int | Literal["tensor"] | None = None,
    pipeline_stages: int | None = None,
    topology: Topology | None = None,
    with_error_feedback: bool = False,
    first_hop_bits: int = 4,
    hadamard_block: int | None = None,
) -> PreparedReduceScatterQ4:
    """A :class:`PreparedReduceScatterQ4` for calls on tensors like ``outputs`` and ``inputs`` (same
    count, sizes, dtype and device; [Note: prepared calls]), with the arguments of
    :func:`reduce_scatter_q4_coalesced`; ``with_error_feedback`` says whether every call passes an
    :class:`ErrorFeedback`. Raises what the collective would raise for these arguments. Like the
    collective's first call on a group, preparing may create zcomm's private subgroups (a
    collective step), so every rank prepares at the same point of its sequence of collectives.
    """
    group = group if group is not None else dist.group.WORLD
    if not isinstance(with_error_feedback, bool):
        raise TypeError(f"with_error_feedback must be a bool, got {with_error_feedback!r}")
    options = _options(group_size, pipeline_stages, first_hop_bits, hadamard_block, with_error_feedback)
    plan = _plan_of_call(group, outputs, inputs, topology, options, coalesced=True)
    key = coalesced_key(outputs, inputs, False, topology)
    if key is None:
        raise ValueError("a prepared reduce_scatter_q4 needs lists or tuples of plain torch.Tensor objects")
    return PreparedReduceScatterQ4(plan, group, _divisor(op, plan.info.world_size), key, with_error_feedback)


def _divisor(op: dist.ReduceOp, world_size: int) -> float:
    """What the fp32 sum is divided by for ``op`` ([Note: PREMUL_SUM as a division])."""
    if getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM:
        factor = op.factor
        if not isinstance(factor, float) or not 0.0 < factor < float("inf"):
            raise ValueError(f"PREMUL_SUM needs a positive finite Python float factor, got {factor!r}")
        return 1.0 / factor
    if op == dist.ReduceOp.SUM:
        return 1.0
    if op == dist.ReduceOp.AVG:
        return float(world_size)
    raise ValueError(f"op must be ReduceOp.SUM, ReduceOp.AVG or ReduceOp.PREMUL_SUM(factor), got {op}")


def check_first_hop_bits(bits: int, name: str = "first_hop_bits") -> None:
    """``bits`` is 4 or 8 (the width of step 1's rows); ``name`` names it in the error."""
    if isinstance(bits, bool) or bits not in (4, 8):
        raise ValueError(f"{name} must be 4 or 8, got {bits!r}")


def _make_plan(
    group: dist.ProcessGroup, info: GroupInfo, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
    group_size: int | Literal["tensor"] | None, pipeline_stages: int | None, first_hop_bits: int,
    hadamard_block: int | None, with_feedback: bool,
) -> ReducePlan:
    """The plan of the checked pairs (``info``: what the prologue resolved) on ``group`` with these
    options, which are checked here; it does not hold ``group`` ([Note: plan cache lifetime])."""
    check_stages(pipeline_stages)
    check_first_hop_bits(first_hop_bits)
    if first_hop_bits == 8 and with_feedback:
        raise ValueError("first_hop_bits=8 cannot be combined with error_feedback (its errors model INT4 hops)")
    check_hadamard_block(hadamard_block)
    if hadamard_block is not None and with_feedback:
        raise ValueError("hadamard_block cannot be combined with error_feedback (its errors would mix rotated and "
                         "unrotated values if the block changed between calls)")
    spec = quant.QuantSpec(bits=_BITS, group_size=group_size)
    slice_numel = sum(output.numel() for output in outputs)
    first, device = inputs[0], inputs[0].device
    topology = info.topology
    # step 1's rows cross nodes when there is one rank per node: INT4 then
    first_bits = _BITS if topology.local_size == 1 else first_hop_bits
    stages = pipeline_stages if pipeline_stages is not None else (
        default_pipeline_stages(slice_numel * info.world_size * first.element_size(), slice_numel, topology))
    part = -(-slice_numel // stages)
    # "tensor": one group as long as the longest payload row (the intra hop's, N parts), so one per row
    concrete_group_size = spec.group_size_for(topology.num_nodes * part)
    perm = reorder_permutation(topology.num_nodes, topology.local_size, stages)
    num_rows = first_hop_rows(topology.num_nodes, topology.local_size, stages)
    uses = kernel_uses(topology, stages, part, concrete_group_size, first_bits, perm, num_rows, len(inputs),
                       len(inputs) == 1 and first.numel() == topology.world_size * stages * part,
                       torch.float32 if hadamard_block is not None else first.dtype, with_feedback)
    return ReducePlan(
        info=info, groups=node_groups(group, topology, "reduce"), stages=stages, part=part,
        group_size=concrete_group_size, first_bits=first_bits, perm=perm, num_rows=num_rows,
        bytes_sent=_bytes_sent(topology, stages, part, concrete_group_size, first_bits),
        kernels=plan_kernels(device, uses) if stages * part else None,
        row_nbytes=quant.payload_nbytes(topology.world_size * stages * part // num_rows, first_bits, concrete_group_size),
        requant_nbytes=quant.payload_nbytes(part, _BITS, concrete_group_size), hadamard_block=hadamard_block,
        feedback_geometry=(stages * part, info.world_size, topology.num_nodes, stages, concrete_group_size),
        stats=stats_row("reduce_scatter_q4"), worker=chain_worker(group, topology, "reduce", device),
    )


def kernel_uses(topology: Topology, stages: int, part: int, group_size: int, first_bits: int, perm: tuple[int, ...],
                num_rows: int, tensors: int, flat: bool, dtype: torch.dtype, with_feedback: bool) -> dict[str, list]:
    """Every kernel call the chain makes, as the uses its plan's kernels are planned for ([Note:
    planned kernels] in :mod:`zcomm.quant._contract`): step 1 on ``tensors`` inputs (``flat``: one
    that fills its parts) of ``dtype`` (fp32 when rotated, which the output's reduction also is),
    step 3 and step 5, and error feedback's stored errors and compensated rows."""
    num_nodes, world_size = topology.num_nodes, topology.world_size
    fp32, numel, two_hops = torch.float32, world_size * stages * part, num_nodes > 1 and topology.local_size > 1
    stage_rows = num_rows // stages
    uses: dict[str, list] = {op: [] for op in ("quantize", "dequantize", "reorder_quantize", "dequant_reduce",
                                               "dequant_reduce_requant")}
    last_bits = first_bits if num_nodes == 1 else _BITS
    uses["dequant_reduce"].append(dequantize_use(num_nodes if two_hops else stage_rows, part, last_bits, group_size,
                                                 dtype))
    if not with_feedback:
        uses["reorder_quantize"].append(reorder_use(tensors, flat, world_size, stages * part, perm, num_rows, first_bits,
                                                    group_size, dtype))
        if two_hops:
            uses["dequant_reduce_requant"].append(requant_use(stage_rows, num_nodes * part, first_bits, _BITS,
                                                              group_size, 1.0, num_nodes))
        return uses
    # [Note: feedback kernels] in zcomm._error_feedback: each hop's stored errors, the compensated rows
    # per hop with feedback: its stored error's numel, and the values, rows and rows per stage it
    # compensates (hop 1 a stage's rows in chunks, hop 2 the node's sum: [Note: feedback in chunks])
    hops = [(numel, numel, num_rows, num_rows // stages)]
    if two_hops:
        hops.append((num_nodes * stages * part, num_nodes * part, num_nodes, num_nodes))
    for hop_numel, *_ in hops:
        uses["dequantize"].append(dequantize_use(1, hop_numel, _STORE_BITS, group_size, fp32))
        uses["quantize"].append(quantize_use(hop_numel, _STORE_BITS, group_size, fp32))
    for _, values, rows, per_stage in hops:
        row_numel = values // rows
        for count in chunk_row_counts(rows, per_stage):
            uses["reorder_quantize"].append(reorder_use(1, True, 1, count * row_numel, _identity(count), count, _BITS,
                                                        group_size, fp32))
            uses["dequantize"].append(dequantize_use(count, row_numel, _BITS, group_size, fp32))
    if two_hops:
        uses["dequant_reduce"].append(dequantize_use(stage_rows, num_nodes * part, _BITS, group_size, fp32))
    return uses


def _bytes_sent(topology: Topology, k: int, q: int, group_size: int, first_bits: int) -> tuple[int, int]:
    """(intra, inter) bytes of the all-to-all rows this rank sends to other ranks (comm_stats model)."""
    if q == 0:
        return 0, 0
    inter = k * (topology.num_nodes - 1) * quant.payload_nbytes(q, _BITS, group_size)
    intra = k * (topology.local_size - 1) * quant.payload_nbytes(topology.num_nodes * q, first_bits, group_size)
    return intra, inter


def _chain(plan: ReducePlan, divide_by: float, feedback: ErrorFeedback | None, outputs: list[torch.Tensor],
           inputs: list[torch.Tensor]) -> None:
    """Steps 1-5 of the module docstring, on this thread (or enqueued on the current CUDA stream)."""
    topology, k, q = plan.info.topology, plan.stages, plan.part
    block = plan.hadamard_block
    if block is not None:
        inputs = rotated_input(inputs, topology.world_size, block)
    # slices zero-filled to k * q elements when q does not divide them: read, never staged
    errors = None
    if feedback is None:
        rows = torch.empty((plan.num_rows, plan.row_nbytes), dtype=torch.uint8, device=inputs[0].device)
        plan.kernels.reorder_quantize(
            inputs, topology.world_size, k * q, plan.perm, plan.num_rows, plan.first_bits, plan.group_size, rows
        )
    else:
        errors = _feedback_errors(plan, feedback, inputs[0].device)
        rows = torch.empty((plan.num_rows, plan.row_nbytes), dtype=torch.uint8, device=inputs[0].device)
        reordered = reordered_view(inputs, topology.num_nodes, topology.local_size, k, k * q)
        feedback.compensate_input(reordered, errors[0], rows, plan.group_size, plan.kernels)
        del reordered
    sizes = [output.numel() for output in outputs]
    result = None if block is not None else _flat_view(outputs, sum(sizes))
    staged = result is None
    if staged:  # fp32 when rotated: rotated back before the output dtype's rounding
        dtype = torch.float32 if block is not None else outputs[0].dtype
        result = torch.empty(sum(sizes), dtype=dtype, device=outputs[0].device)
    out_parts, short = _stage_parts(result, k, q)
    _pipeline(plan, divide_by, feedback, rows, out_parts, errors)
    if errors is not None:
        feedback.end(errors, plan.group_size, plan.kernels)
    for piece, computed in short:
        piece.copy_(computed[: piece.numel()])
    if block is not None:
        rotate_back_(result, sizes, block)
    if staged:
        for output, piece in zip(outputs, result.split(sizes), strict=True):
            output.view(-1).copy_(piece)


def _feedback_errors(plan: ReducePlan, feedback: ErrorFeedback, device: torch.device) -> list[torch.Tensor]:
    """This call's fp32 errors: hop 1's over the whole reordered input, hop 2's over the
    node sums this rank re-quantizes (none with one node or one rank per node)."""
    topology, k, q = plan.info.topology, plan.stages, plan.part
    hops = [topology.world_size * k * q]
    if topology.num_nodes > 1 and topology.local_size > 1:
        hops.append(topology.num_nodes * k * q)
    return feedback.begin(hops, plan.group_size, device, plan.kernels)


def _stage_parts(result: torch.Tensor, stages: int, part: int) -> tuple[Sequence[torch.Tensor], list[tuple]]:
    """Where each stage writes its ``part`` elements: ``result[s*q : (s+1)*q]``, or, for a part that
    reaches into the zero fill, a buffer of its own, listed in ``short`` with the real piece to copy to.

    The whole parts are one ``unbind`` of ``result`` viewed as rows (one call, not one slice per stage).
    """
    numel = result.numel()
    if numel == stages * part:  # one stage (one node's default): ``result`` itself, no view ops
        return ((result,) if stages == 1 else result.view(stages, part).unbind(0)), []
    whole = numel // part
    out_parts = list(result[: whole * part].view(whole, part).unbind(0))
    short = []
    for start in range(whole * part, stages * part, part):
        short.append((result[start : start + part], torch.empty(part, dtype=result.dtype, device=result.device)))
        out_parts.append(short[-1][1])
    return out_parts, short


def _flat_view(outputs: list[torch.Tensor], numel: int) -> torch.Tensor | None:
    """The ``numel`` elements of ``outputs`` as one flat tensor when they lie end to end in one
    storage (as the pieces of ``flat.split(sizes)`` do), else None."""
    if len(outputs) == 1:  # one contiguous output (the prologue checked it): a bucket of one tensor
        return outputs[0].view(-1)
    tensors = [output for output in outputs if output.numel()]
    first = tensors[0]
    storage, address = first.untyped_storage().data_ptr(), first.data_ptr()
    for output in tensors:
        if output.untyped_storage().data_ptr() != storage or output.data_ptr() != address:
            return None
        address += output.numel() * output.element_size()
    return first.as_strided((numel,), (1,))


def _pipeline(plan: ReducePlan, divide_by: float, feedback: ErrorFeedback | None, rows: torch.Tensor,
              out_parts: Sequence[torch.Tensor], errors: list[torch.Tensor] | None) -> None:
    """Run the ``k`` stages' hops on ``rows`` (from step 1), writing stage ``s`` to ``out_parts[s]``.

    [Note: hop overlap] The intra hops of the first two stages are issued first (their group
    runs them in order), and stage ``s + 2``'s as soon as stage ``s``'s has been reduced, so the
    intra-node link has the next stage to carry while this one is reduced ([Note: qgZ in-flight
    bound]). Stage ``s``'s inter hop is issued as soon as its intra hop is reduced, and its
    final reduction waits until stage ``s+1``'s inter hop is issued, so the inter-node link
    carries stage ``s`` while the intra-node link carries stage ``s+1``. Every receive buffer
    stays referenced until its reduction has consumed it.

    [Note: qgZ in-flight bound] Issuing every stage's intra hop up front would hold ``k``
    receive buffers (as many bytes as step 1's rows) for the whole call. Two stages at once (the
    one being reduced, the next on the wire) keep the intra-node link as busy: a hop on that
    group cannot start before the previous one has finished anyway, and the next is queued
    before this stage's reduction begins, so the link idles only if a hop is shorter than a
    reduction, when more hops queued would not help either.
    """
    k, num_nodes, local_size = plan.stages, plan.info.topology.num_nodes, plan.info.topology.local_size
    # each stage's rows: one view per stage from one unbind (one stage: the rows themselves)
    stage_rows = (rows,) if k == 1 else rows.view(k, -1, rows.shape[1]).unbind(0)
    # the rows every stage reduces last are step 1's width when the node is the whole group, else INT4
    reduce, last_bits = plan.kernels.dequant_reduce, plan.first_bits if num_nodes == 1 else _BITS
    part, group_size = plan.part, plan.group_size
    intra: list[tuple[torch.Tensor, dist.Work]] = []  # the intra hops in flight, oldest first
    if local_size > 1:
        intra = [_all_to_all(stage_rows[s], plan.groups.intra) for s in range(min(k, 2))]
    if num_nodes == 1:
        for s in range(k):
            if intra:
                received, work = intra.pop(0)
                work.wait()
            else:
                received, work = stage_rows[s], None
            reduce(received, part, last_bits, group_size, divide_by, out_parts[s])
            del received, work  # a gloo Work holds its tensors
            _issue_intra(plan, stage_rows, intra, s + 2)
        return
    in_flight: list[tuple[int, torch.Tensor, dist.Work]] = []
    for s in range(k):
        if intra:
            sent = _node_sum_rows(plan, feedback, intra.pop(0), s, errors)
            _issue_intra(plan, stage_rows, intra, s + 2)
        else:
            sent = stage_rows[s]
        in_flight.append((s, *_all_to_all(sent, plan.groups.inter)))
        del sent
        if len(in_flight) == 2:
            done, received, work = in_flight.pop(0)
            work.wait()
            reduce(received, part, last_bits, group_size, divide_by, out_parts[done])
            del received, work
    for done, received, work in in_flight:
        work.wait()
        reduce(received, part, last_bits, group_size, divide_by, out_parts[done])


def _issue_intra(plan: ReducePlan, stage_rows: Sequence[torch.Tensor], intra: list[tuple[torch.Tensor, dist.Work]],
                 stage: int) -> None:
    """Start ``stage``'s intra hop, if there is such a stage and an intra hop ([Note: qgZ in-flight bound])."""
    if plan.info.topology.local_size > 1 and stage < len(stage_rows):
        intra.append(_all_to_all(stage_rows[stage], plan.groups.intra))


def _node_sum_rows(plan: ReducePlan, feedback: ErrorFeedback | None, hop: tuple[torch.Tensor, dist.Work], stage: int,
                   errors: list[torch.Tensor] | None) -> torch.Tensor:
    """Stage ``stage``'s ``N`` rows for the inter-node hop once its intra hop delivered: the
    node's sum re-quantized to INT4 (step 3), compensated by hop 2's error with feedback."""
    received, work = hop
    work.wait()
    num_nodes = plan.info.topology.num_nodes
    numel = num_nodes * plan.part
    if feedback is None:  # INT4 (or INT8) rows in, the node's sum re-quantized to INT4 rows
        requant = torch.empty((num_nodes, plan.requant_nbytes), dtype=torch.uint8, device=received.device)
        plan.kernels.dequant_reduce_requant(received, numel, plan.first_bits, _BITS, plan.group_size, 1.0, requant)
        return requant
    node_sum = torch.empty(numel, dtype=torch.float32, device=received.device)
    plan.kernels.dequant_reduce(received, numel, _BITS, plan.group_size, 1.0, node_sum)
    error = errors[1][stage * numel : (stage + 1) * numel]
    return feedback.compensate_quantize(node_sum, error, num_nodes, plan.group_size, plan.kernels)


def _all_to_all(send: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, dist.Work]:
    """Start row ``i`` of ``send`` to rank ``i`` of ``group``; returns (receive buffer, work)."""
    received = torch.empty_like(send)
    return received, start_hop(dist.all_to_all_single, received, send, group)
