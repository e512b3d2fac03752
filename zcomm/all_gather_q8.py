"""qwZ: hierarchical all-gather with blocked INT8 quantization (ZeRO++ section 3.1).

On ``W = N * L`` ranks (``N`` nodes of ``L`` ranks, node-major; rank ``n*L + l`` is local
rank ``l`` of node ``n``):

1. each rank quantizes its input into one self-contained INT8 payload of ``P`` bytes
   (values, padding and fp32 scales in one ``uint8`` buffer, see
   :mod:`zcomm.quant.wire_format`);
2. inter-node hop: all-gather of that payload among the ``N`` ranks with this local rank
   (zcomm's private inter-node group), giving ``N`` payloads in node order;
3. intra-node hop: all-gather of those ``N * P`` bytes among the ``L`` ranks of the node
   (zcomm's private intra-node group). Every rank now holds all ``W`` payloads laid out
   ``[local rank l][node n]``;
4. the payload of rank ``r = n*L + l`` is dequantized into ``output[r*numel : (r+1)*numel]``
   (``numel = input.numel()``).

Only ``N - 1`` payloads leave each rank across nodes, so a node's uplink carries
``L * (N - 1)`` payloads where a flat ring in rank order makes the node's boundary rank
send ``W - 1`` (1.5x more on 2 nodes x 2 ranks). One node: step 2 is skipped; one rank
per node: step 3 is skipped (a single hop is a flat all-gather of the ``W`` payloads).
The payloads and their dequantization are the flat algorithm's, so ``output`` is
bit-identical to quantize -> one all-gather -> dequantize.

Error: every element is within half its group's scale (``absmax / 127 / 2``) of the
original before the final rounding to the output dtype. Any ``numel`` works: the last
group of a payload is simply short.

Pipelining: with ``k > 1`` stages the input is cut into ``k`` chunks of whole
quantization groups, each quantized into its own payload and carried through steps 2-4 on
its own, so chunk ``c``'s intra-node hop runs while chunk ``c + 1``'s inter-node hop is on
the wire and chunk ``c - 1`` is dequantized ([Note: qwZ pipeline]). Every element keeps
its quantization group, scale and code, so ``output`` is bit-identical to the unpipelined
form's; only the payloads' alignment padding can add a few bytes per chunk. The default
(:func:`default_pipeline_stages`) pipelines only large gathers over two hops.

Buffers: the ``P``-byte payload, the ``N * P`` bytes gathered by step 2 and the ``W * P``
bytes gathered by step 3 (all ``uint8``, per chunk; with several nodes of several ranks,
also a copy of them in rank order for step 4's single dequantize; pipelined, instead the
chunk's ``W`` dequantized rows, copied into their places in ``output`` by one strided copy,
see [Note: qwZ chunk decode])
live for one call; ``output`` is written only in step 4.

[Note: qwZ buffer lifetime] The chain keeps each hop's send buffer referenced until that hop's
``wait()`` has returned, and the last hop's receive buffer until step 4 has consumed it. On
CUDA the buffers are allocated on the stream the chain is enqueued on and the process
group records their use on its stream, so the allocator does not hand them out early.

[Note: qwZ pipeline] Pipelined, every chunk is quantized and its inter-node hop started up
front (the group runs them in order, so quantizing chunk ``c + 1`` overlaps chunk ``c``'s
hop); chunk ``c``'s intra-node hop starts as soon as its inter-node hop delivered, and
chunk ``c``'s dequantization waits until chunk ``c + 1``'s intra-node hop is started. Each
hop's send buffer stays referenced with its receive buffer until the hop's ``wait()``.

[Note: qwZ direct kernels] The chain calls the plan's ``quantize`` and ``dequantize``
kernels directly, not the public ops: the plan ([Note: one plan per call] in
:mod:`zcomm._plan`) already checked the tensors and resolved what the public ops check on
every call (the spec and its int group size, the payload sizes, the backend: ``backend=`` is
not an option here, so ``$ZCOMM_BACKEND``, then the device), and planned both kernels for
every chunk ([Note: planned kernels] in :mod:`zcomm.quant._contract`: on CUDA each launch is
resolved then, before the first hop). Each call then skips the ops' checks, the backend
choice and the dispatcher, and the kernels get exactly the contract's arguments: contiguous
1-D inputs, payloads of the planned size, non-empty (a call of empty inputs writes nothing
and sends nothing, on every rank alike). ``$ZCOMM_BACKEND`` is read when a plan is made: a
plan keeps its backend.

[Note: hop order] Steps 1-4 run as one chain (:mod:`zcomm._chain_runner`) of the
``"gather"`` kind: on its own private groups and, on CPU, on the FIFO worker of the
group's gathers, so every rank issues the hops of all its qwZ calls in one order, inter
hop before intra hop, while qgZ calls run independently on theirs; sync calls wait for
the chain, async calls return its handle.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
import torch.distributed as dist

from . import quant
from ._chain_runner import chain_worker, run_chain
from ._contract import GroupInfo, Handle
from ._groups import node_groups
from ._hop_release import start_hop
from ._pipeline import GATHER_STAGE_BYTES, check_stages, default_stages
from ._plan import Plan, check_plannable, find_plan, keep_plan, plan_kernels
from ._prologue import prologue
from ._torch_compat import all_gather_single
from .comm_stats import stats_row
from .quant._contract import dequantize_use, quantize_use
from .quant._plain import PLAIN_TENSORS
from .topology import Topology

__all__ = ["GATHER_STAGE_BYTES", "PreparedAllGatherQ8", "all_gather_q8", "default_pipeline_stages",
           "prepare_all_gather_q8"]

_BITS = 8
# a hop in flight: (send buffer, receive buffer, work), kept together until its wait(); the
# send buffer and work are None for a chunk whose single hop already delivered
_Hop = tuple[torch.Tensor | None, torch.Tensor, dist.Work | None]


class GatherPlan(Plan):
    """qwZ's plan ([Note: one plan per call] in :mod:`zcomm._plan`): what :class:`~zcomm._plan.Plan`
    holds, and the hops, chunks and payload sizes."""

    __slots__ = ("hops", "hop_sizes", "group_size", "bounds", "chunk_nbytes")

    hops: tuple[dist.ProcessGroup, ...]  # the inter-node group, then the intra-node group, where they have peers
    hop_sizes: tuple[int, ...]  # each hop's group size
    group_size: int  # concrete: "tensor" resolved for this payload
    bounds: tuple[int, ...]  # chunk c is input elements [bounds[c], bounds[c + 1])
    chunk_nbytes: tuple[int, ...]  # the payload bytes of each chunk


def default_pipeline_stages(output_nbytes: int, num_groups: int, topology: Topology) -> int:
    """The ``pipeline_stages`` used when none is given: one per :data:`GATHER_STAGE_BYTES` (4 MiB)
    of the gathered output, at most 4 and at most one per quantization group, and only with two
    hops (measurements in :mod:`zcomm._pipeline`)."""
    return default_stages(output_nbytes, num_groups, topology, stage_bytes=GATHER_STAGE_BYTES)


def all_gather_q8(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    group_size: int | Literal["tensor"] | None = None,
    pipeline_stages: int | None = None,
    topology: Topology | None = None,
) -> Handle | None:
    """INT8-quantized hierarchical drop-in for ``torch.distributed.all_gather_into_tensor``.

    Args:
        output: contiguous, ``world_size * input.numel()`` elements, same dtype (fp32/bf16/fp16) and device.
        input: contiguous, any shape and numel.
        group: the process group (default: world).
        async_op: return a :class:`zcomm.Handle`; ``output`` is valid after its ``wait()``.
        group_size: elements per quantization scale: an int >= 2, ``"tensor"`` (one scale for
            the whole payload, ZeRO++'s non-blocked ablation) or None (INT8's default,
            ``zcomm.quant.DEFAULT_GROUP_SIZE[8]``); see :class:`zcomm.quant.QuantSpec`.
        pipeline_stages: chunks overlapping the inter- and intra-node hops (default
            :func:`default_pipeline_stages`); chunks are whole quantization groups, so at most
            one stage per group is used (``"tensor"``, or a group of one rank: one stage). The
            output is the same for every value.
        topology: which ranks share a node (default: :meth:`Topology.detect`, run once per group
            and call shape, when its plan is made: [Note: one plan per call] in :mod:`zcomm._plan`).
    """
    group = group if group is not None else dist.group.WORLD
    plan = None
    if type(output) in PLAIN_TENSORS and type(input) in PLAIN_TENSORS and output.is_contiguous() and input.is_contiguous():
        plan = find_plan(group, _key(output, input, topology, group_size, pipeline_stages))
    if plan is None:
        plan = _plan_of_call(group, output, input, topology, group_size, pipeline_stages)
    plan.stats.add(*plan.bytes_sent)
    return run_chain(partial(_chain, plan, output, input), (output, input), async_op, plan.worker)


class PreparedAllGatherQ8:
    """:func:`all_gather_q8` resolved once for one (output, input) shape
    (:func:`prepare_all_gather_q8`), called with tensors of that shape each time.

    The contract and what each call revalidates are those of [Note: prepared calls] in
    :mod:`zcomm.reduce_scatter_q4`: the group (held, with its subgroups and worker), topology
    and options are fixed; each call checks that both tensors are plain contiguous tensors of
    the prepared sizes, dtypes and device (``ValueError`` otherwise) and runs the chain on
    their current addresses.
    """

    __slots__ = ("_plan", "_group", "_signature")

    def __init__(self, plan: GatherPlan, group: dist.ProcessGroup, signature: tuple) -> None:
        self._plan, self._group, self._signature = plan, group, signature

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, async_op: bool = False) -> Handle | None:
        """:func:`all_gather_q8` of ``output`` and ``input`` as prepared."""
        if (
            type(output) not in PLAIN_TENSORS
            or type(input) not in PLAIN_TENSORS
            or not output.is_contiguous()
            or not input.is_contiguous()
            or (output.numel(), input.numel(), output.dtype, input.dtype, output.device, input.device)
            != self._signature
        ):
            raise ValueError("a prepared all_gather_q8 got tensors of other sizes, dtypes or devices (or not plain "
                             "contiguous tensors) than it was prepared for: prepare another one")
        plan = self._plan
        plan.stats.add(*plan.bytes_sent)
        return run_chain(partial(_chain, plan, output, input), (output, input), async_op, plan.worker)


def prepare_all_gather_q8(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    group_size: int | Literal["tensor"] | None = None,
    pipeline_stages: int | None = None,
    topology: Topology | None = None,
) -> PreparedAllGatherQ8:
    """A :class:`PreparedAllGatherQ8` for calls on tensors like ``output`` and ``input`` (same sizes,
    dtypes and device), with the arguments of :func:`all_gather_q8`. Raises what the collective
    would raise for them. Like the collective's first call on a group, preparing may create
    zcomm's private subgroups (a collective step), so every rank prepares at the same point of
    its sequence of collectives."""
    group = group if group is not None else dist.group.WORLD
    plan = _plan_of_call(group, output, input, topology, group_size, pipeline_stages)
    if type(output) not in PLAIN_TENSORS or type(input) not in PLAIN_TENSORS:
        raise ValueError("a prepared all_gather_q8 needs plain torch.Tensor objects")
    signature = (output.numel(), input.numel(), output.dtype, input.dtype, output.device, input.device)
    return PreparedAllGatherQ8(plan, group, signature)


def _key(output: torch.Tensor, input: torch.Tensor, topology: Topology | None,
         group_size: int | Literal["tensor"] | None, pipeline_stages: int | None) -> tuple:
    """The plan key of a call ([Note: one plan per call] in :mod:`zcomm._plan`): each option with its type."""
    return ("all_gather_q8", topology, output.numel(), input.numel(), output.dtype, input.dtype, output.device,
            input.device, type(group_size), group_size, type(pipeline_stages), pipeline_stages)


def _plan_of_call(
    group: dist.ProcessGroup, output: torch.Tensor, input: torch.Tensor, topology: Topology | None,
    group_size: int | Literal["tensor"] | None, pipeline_stages: int | None,
) -> GatherPlan:
    """The plan of a call that did not find one by its key: the tensors checked (the prologue raises
    for the exact reason), then the plan of their key, found or made and kept ([Note: one plan per call])."""
    if isinstance(output, torch.Tensor):
        check_plannable(output.device, "all_gather_q8")
    info = prologue(output, input, group, topology, gather=True, quantized=True)
    key = _key(output, input, topology, group_size, pipeline_stages)
    plan = find_plan(group, key)
    return plan if plan is not None else keep_plan(group, key, _make_plan(
        group, info, output, input, group_size, pipeline_stages))


def _make_plan(
    group: dist.ProcessGroup, info: GroupInfo, output: torch.Tensor, input: torch.Tensor,
    group_size: int | Literal["tensor"] | None, pipeline_stages: int | None,
) -> GatherPlan:
    """The plan of a checked call on ``group`` (``info``: what the prologue resolved) with these
    tensors and options; it does not hold ``group`` ([Note: plan cache lifetime] in
    :mod:`zcomm._plan_cache`)."""
    check_stages(pipeline_stages)
    numel, device = input.numel(), input.device
    output_nbytes = output.numel() * output.element_size()
    concrete_group_size = quant.QuantSpec(bits=_BITS, group_size=group_size).group_size_for(numel)
    groups = node_groups(group, info.topology, "gather")
    hops = tuple(hop for hop in (groups.inter, groups.intra) if hop is not None)
    num_groups = quant.num_groups(numel, concrete_group_size)
    if pipeline_stages is None:
        pipeline_stages = default_pipeline_stages(output_nbytes, num_groups, info.topology)
    # whole groups per chunk; with no hop at all (one rank) there is nothing to overlap
    stages = min(pipeline_stages, max(1, num_groups)) if hops else 1
    bounds = _chunk_bounds(numel, concrete_group_size, stages)
    chunks = [hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]
    chunk_nbytes = tuple(quant.payload_nbytes(hi - lo, _BITS, concrete_group_size) for lo, hi in zip(bounds, bounds[1:], strict=False))
    world_size = info.topology.world_size
    uses = {"quantize": [quantize_use(n, _BITS, concrete_group_size, input.dtype) for n in chunks],
            "dequantize": [dequantize_use(world_size, n, _BITS, concrete_group_size, output.dtype) for n in chunks]}
    return GatherPlan(
        info=info, hops=hops, hop_sizes=tuple(dist.get_world_size(hop) for hop in hops), group_size=concrete_group_size,
        bounds=bounds, chunk_nbytes=chunk_nbytes, bytes_sent=_bytes_sent(info.topology, chunk_nbytes),
        kernels=plan_kernels(device, uses), stats=stats_row("all_gather_q8"),
        worker=chain_worker(group, info.topology, "gather", device),
    )


def _chunk_bounds(numel: int, group_size: int, stages: int) -> tuple[int, ...]:
    """``stages`` chunks of whole groups, their group counts differing by at most one."""
    num_groups = quant.num_groups(numel, group_size)
    return tuple(min(numel, stage * num_groups // stages * group_size) for stage in range(stages)) + (numel,)


def _bytes_sent(topology: Topology, chunk_nbytes: tuple[int, ...]) -> tuple[int, int]:
    """(intra, inter) bytes this rank sends (comm_stats model): each chunk's payload to the ``N - 1``
    other nodes, then the ``N`` payloads of its inter-node hop to the node's ``L - 1`` other ranks."""
    payload_bytes = sum(chunk_nbytes)
    num_nodes, local_size = topology.num_nodes, topology.local_size
    return (local_size - 1) * num_nodes * payload_bytes, (num_nodes - 1) * payload_bytes


def _chain(plan: GatherPlan, output: torch.Tensor, input: torch.Tensor) -> None:
    """Steps 1-4 of the module docstring, on this thread (or enqueued on the current CUDA stream)."""
    if input.requires_grad:  # parameters: read detached, as the public ops do
        input = input.detach()
    if not plan.bounds[-1]:
        return  # every rank's input is empty (the prologue checked the sizes): nothing to send or write
    if len(plan.bounds) == 2:
        _gather_whole(plan, output.view(-1), input.view(-1))
    else:
        _gather_pipelined(plan, output.view(-1), input.view(-1))


def _gather_whole(plan: GatherPlan, output: torch.Tensor, input: torch.Tensor) -> None:
    """Unpipelined: one payload through both hops, then one dequantize of all ``W`` rows in rank order."""
    num_nodes, local_size, numel = plan.topology.num_nodes, plan.topology.local_size, input.numel()
    # ``wait()`` returns only after its hop has read ``gathered`` (see [Note: qwZ buffer lifetime])
    gathered = _quantize(plan, input, plan.chunk_nbytes[0])
    for hop, size in zip(plan.hops, plan.hop_sizes, strict=True):
        _, gathered, work = _start_gather(gathered, hop, size)
        work.wait()
    world_size = plan.topology.world_size
    row_bytes = gathered.numel() // world_size
    # the rows arrive [local rank][node], the ranks are [node][local rank]: one dequantize of
    # all W rows in rank order (reshape copies the payload bytes only when both are > 1; with one
    # node, or one rank per node, the arrival order is the rank order: one view, no transpose)
    if num_nodes == 1 or local_size == 1:
        in_rank_order = gathered.view(world_size, row_bytes)
    else:
        in_rank_order = gathered.view(local_size, num_nodes, row_bytes).transpose(0, 1).reshape(world_size, row_bytes)
    plan.kernels.dequantize(in_rank_order, numel, _BITS, plan.group_size, output)


def _quantize(plan: GatherPlan, chunk: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The payload of the non-empty 1-D ``chunk`` ([Note: qwZ direct kernels])."""
    payload = torch.empty(nbytes, dtype=torch.uint8, device=chunk.device)
    plan.kernels.quantize(chunk, _BITS, plan.group_size, payload)
    return payload


def _gather_pipelined(plan: GatherPlan, output: torch.Tensor, input: torch.Tensor) -> None:
    """The chunks' hops overlapped as [Note: qwZ pipeline] says; ``output`` and ``input`` flat."""
    chunks = list(zip(plan.bounds, plan.bounds[1:], strict=False))
    first_hop, first_size = plan.hops[0], plan.hop_sizes[0]
    first = [
        _start_gather(_quantize(plan, input[lo:hi], nbytes), first_hop, first_size)
        for (lo, hi), nbytes in zip(chunks, plan.chunk_nbytes, strict=True)
    ]
    in_flight: list[tuple[tuple[int, int], _Hop]] = []
    for chunk in chunks:
        # popped, so that a chunk's payload goes once its hop delivered, not with the call
        sent, received, work = first.pop(0)
        work.wait()
        del sent
        second = (_start_gather(received, plan.hops[1], plan.hop_sizes[1]) if len(plan.hops) > 1
                  else (None, received, None))
        del received
        in_flight.append((chunk, second))
        del second
        if len(in_flight) == 2:
            _finish_chunk(plan, *in_flight.pop(0), output)
    for chunk, hop in in_flight:
        _finish_chunk(plan, chunk, hop, output)


def _finish_chunk(plan: GatherPlan, chunk: tuple[int, int], hop: _Hop, output: torch.Tensor) -> None:
    """Wait for ``chunk``'s last hop and dequantize every rank's payload into its place in ``output``.

    [Note: qwZ chunk decode] One multi-row dequantize per chunk (a call per rank would cost
    ``W`` op calls per chunk on the host): the ``W`` rows as they arrived, ``[local rank][node]``,
    into a ``W x chunk`` buffer, then one strided copy that puts each row in its rank's place,
    the chunk's column of ``output`` viewed as ``[node][local rank]`` rows of ``numel`` (each
    row of ``output`` is one rank's input). The copy reorders the rows, so the payload bytes
    are never copied into rank order. The buffer stays: the kernels' contract writes a
    contiguous ``out``, and the chunk's column of ``output`` is ``W`` rows ``numel`` apart.
    """
    _, gathered, work = hop
    if work is not None:
        work.wait()
    (lo, hi), topology, numel = chunk, plan.topology, plan.bounds[-1]
    num_nodes, local_size = topology.num_nodes, topology.local_size
    rows = gathered.view(topology.world_size, -1)
    values = torch.empty(topology.world_size * (hi - lo), dtype=output.dtype, device=output.device)
    plan.kernels.dequantize(rows, hi - lo, _BITS, plan.group_size, values)
    del rows, gathered, hop
    arrived = values.view(local_size, num_nodes, hi - lo).transpose(0, 1)
    output.view(num_nodes, local_size, numel)[:, :, lo:hi].copy_(arrived)


def _start_gather(send: torch.Tensor, group: dist.ProcessGroup, size: int) -> _Hop:
    """Start gathering the ``size`` members' ``send`` buffers of ``group`` in group-rank order: (send,
    receive buffer, work)."""
    received = torch.empty(size * send.numel(), dtype=send.dtype, device=send.device)
    return send, received, start_hop(all_gather_single, received, send, group)
