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

Buffers: the ``P``-byte payload, the ``N * P`` bytes gathered by step 2 and the ``W * P``
bytes gathered by step 3 (all ``uint8``; with several nodes of several ranks, also a copy
of them in rank order for step 4's single dequantize) live for one call; ``output`` is
written only in step 4.

[Note: qwZ buffer lifetime] The chain keeps each hop's send buffer referenced until that hop's
``wait()`` has returned, and the last hop's receive buffer until step 4 has consumed it. On
CUDA the buffers are allocated on the stream the chain is enqueued on and the process
group records their use on its stream, so the allocator does not hand them out early.

[Note: hop order] Steps 1-4 run as one chain (:mod:`zcomm._chain_runner`) of the
``"gather"`` kind: on its own private groups and, on CPU, on the FIFO worker of the
group's gathers, so every rank issues the hops of all its qwZ calls in one order, inter
hop before intra hop, while qgZ calls run independently on theirs; sync calls wait for
the chain, async calls return its handle.
"""

from __future__ import annotations

from functools import partial
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist

from . import quant
from ._api import Handle
from ._chain_runner import run_chain
from ._groups import node_groups
from ._prologue import prologue
from ._torch_compat import all_gather_single
from .comm_stats import record
from .topology import Topology

__all__ = ["all_gather_q8"]

_BITS = 8


class _Plan(NamedTuple):
    """Everything the chain needs, fixed at call time on the caller's thread."""

    hops: tuple[dist.ProcessGroup, ...]  # the inter-node group, then the intra-node group, where they have peers
    topology: Topology
    group_size: int  # concrete: "tensor" resolved for this payload


def all_gather_q8(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    group_size: int | Literal["tensor"] | None = None,
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
        topology: which ranks share a node (default: :meth:`Topology.detect`).
    """
    info = prologue(output, input, group, topology, gather=True, quantized=True)
    spec = quant.QuantSpec(bits=_BITS, group_size=group_size)
    groups = node_groups(info.group, info.topology, "gather")
    hops = tuple(hop for hop in (groups.inter, groups.intra) if hop is not None)
    plan = _Plan(hops, info.topology, spec.group_size_for(input.numel()))
    record("all_gather_q8", *_bytes_sent(plan, input.numel()))
    return run_chain(partial(_chain, plan, output, input), info, "gather", (output, input), async_op)


def _bytes_sent(plan: _Plan, numel: int) -> tuple[int, int]:
    """(intra, inter) bytes this rank sends (comm_stats model): its payload to the ``N - 1`` other
    nodes, then the ``N`` payloads of its inter-node hop to the node's ``L - 1`` other ranks."""
    payload_bytes = quant.payload_nbytes(numel, _BITS, plan.group_size)
    num_nodes, local_size = plan.topology.num_nodes, plan.topology.local_size
    return (local_size - 1) * num_nodes * payload_bytes, (num_nodes - 1) * payload_bytes


def _chain(plan: _Plan, output: torch.Tensor, input: torch.Tensor) -> None:
    """Steps 1-4 of the module docstring, on this thread (or enqueued on the current CUDA stream)."""
    num_nodes, local_size, numel = plan.topology.num_nodes, plan.topology.local_size, input.numel()
    # [Note: qwZ buffer lifetime] ``_all_gather`` returns only after its hop has read ``gathered``
    gathered = quant.quantize(input.reshape(-1), _BITS, plan.group_size)
    for hop in plan.hops:
        gathered = _all_gather(gathered, hop)
    world_size = plan.topology.world_size
    row_bytes = gathered.numel() // world_size
    # the rows arrive [local rank][node], the ranks are [node][local rank]: one dequantize of
    # all W rows in rank order (reshape copies the payload bytes only when both are > 1)
    in_rank_order = gathered.view(local_size, num_nodes, row_bytes).transpose(0, 1).reshape(world_size, row_bytes)
    quant.dequantize(in_rank_order, numel, _BITS, plan.group_size, output.dtype, out=output)


def _all_gather(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``group``'s members' ``send`` buffers concatenated in group-rank order (on CUDA: once the stream gets there)."""
    received = torch.empty(dist.get_world_size(group) * send.numel(), dtype=send.dtype, device=send.device)
    all_gather_single(received, send, group=group, async_op=True).wait()
    return received
