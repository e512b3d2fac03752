"""The unquantized communication objects: stage 1-3's defaults.

They call zcomm's counted pass-throughs (``zcomm.all_gather_into_tensor``,
``zcomm.reduce_scatter_tensor``), so ``zcomm.comm_stats()`` sees the runtime's traffic and
plain stage 3 and ZeRO++ are measured by the same counters; ``topology`` (which ranks share
a node) lets the counters split intra- from inter-node bytes.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

import zcomm

from ._api import AllGather, Handle, Phase, ReduceScatter


class PlainAllGather(AllGather):
    """Unquantized all-gather over one process group (stage 3's default in both phases)."""

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
        self.group = group
        self.topology = topology

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, unit: Hashable, phase: Phase) -> Handle:
        return zcomm.all_gather_into_tensor(output, input, group=self.group, async_op=True, topology=self.topology)


class PlainReduceScatter(ReduceScatter):
    """Unquantized SUM reduce-scatter over one process group."""

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
        self.group = group
        self.topology = topology

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, bucket: int) -> Handle:
        return zcomm.reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=True,
                                           topology=self.topology)
