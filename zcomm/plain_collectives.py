"""Unquantized all-gather, reduce-scatter and all-reduce, counted in :mod:`zcomm.comm_stats`.

Thin pass-throughs to ``torch.distributed.all_gather_into_tensor``, ``reduce_scatter_tensor``
and ``all_reduce`` that record the bytes the bandwidth-optimal ring would send (the same
model as the quantized collectives), so a runtime can switch between plain ZeRO-3 and
ZeRO++ traffic and compare the two in one set of counters. The ring all-reduce is a ring
reduce-scatter and a ring all-gather of ``ceil(numel / W)``-element chunks: ``2 (W - 1)``
chunks to the next rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._prologue import prologue, resolve_group
from ._torch_compat import all_gather_single, reduce_scatter_single
from .comm_stats import record
from .topology import Topology

__all__ = ["all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor"]


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    topology: Topology | None = None,
) -> dist.Work | None:
    """``torch.distributed.all_gather_into_tensor``, recorded as ``"all_gather_into_tensor"``."""
    info = prologue(output, input, group, topology, gather=True, quantized=False)
    record("all_gather_into_tensor", *_ring_bytes(input.numel() * input.element_size(), info.rank, info.topology))
    return all_gather_single(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    topology: Topology | None = None,
) -> dist.Work | None:
    """``torch.distributed.reduce_scatter_tensor``, recorded as ``"reduce_scatter_tensor"``."""
    info = prologue(output, input, group, topology, gather=False, quantized=False)
    record("reduce_scatter_tensor", *_ring_bytes(output.numel() * output.element_size(), info.rank, info.topology))
    return reduce_scatter_single(output, input, op=op, group=group, async_op=async_op)


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    topology: Topology | None = None,
) -> dist.Work | None:
    """``torch.distributed.all_reduce`` (in place), recorded as ``"all_reduce"``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    info = resolve_group(group, topology, tensor.device)
    chunk = -(-tensor.numel() // info.world_size) * tensor.element_size()
    intra, inter = _ring_bytes(chunk, info.rank, info.topology)
    record("all_reduce", 2 * intra, 2 * inter)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def _ring_bytes(chunk_bytes: int, rank: int, topology: Topology) -> tuple[int, int]:
    """(intra, inter) bytes ``rank`` sends in a ring all-gather / reduce-scatter of ``chunk_bytes`` chunks."""
    world_size = topology.world_size
    sent = (world_size - 1) * chunk_bytes
    return (sent, 0) if topology.same_node(rank, (rank + 1) % world_size) else (0, sent)
