"""Unquantized all-gather and reduce-scatter, counted in :mod:`zcomm.comm_stats`.

Thin pass-throughs to ``torch.distributed.all_gather_into_tensor`` and
``reduce_scatter_tensor`` that record the bytes the bandwidth-optimal ring would send
(the same model as the quantized collectives), so a runtime can switch between plain
ZeRO-3 and ZeRO++ traffic and compare the two in one set of counters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm_stats import record, ring_bytes
from ._prologue import check_tensors, resolve_group
from .topology import Topology
from ._torch_compat import all_gather_single, reduce_scatter_single


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    topology: Topology | None = None,
) -> dist.Work | None:
    """``torch.distributed.all_gather_into_tensor``, recorded as ``"all_gather_into_tensor"``."""
    info = resolve_group(group, topology)
    check_tensors(output, input, world=info.world_size, gather=True, quantized=False)
    intra, inter = ring_bytes(input.numel() * input.element_size(), info.rank, info.topology)
    record("all_gather_into_tensor", intra_bytes=intra, inter_bytes=inter)
    return all_gather_single(output, input, group=info.group, async_op=async_op)


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
    info = resolve_group(group, topology)
    check_tensors(output, input, world=info.world_size, gather=False, quantized=False)
    intra, inter = ring_bytes(output.numel() * output.element_size(), info.rank, info.topology)
    record("reduce_scatter_tensor", intra_bytes=intra, inter_bytes=inter)
    return reduce_scatter_single(output, input, op=op, group=info.group, async_op=async_op)
