"""The unquantized communication objects: stage 1-3's defaults.

They call zcomm's counted pass-throughs (``zcomm.all_gather_into_tensor``,
``zcomm.reduce_scatter_tensor``), so ``zcomm.comm_stats()`` sees the runtime's traffic and
plain stage 3 and ZeRO++ are measured by the same counters; ``topology`` (which ranks share
a node) lets the counters split intra- from inter-node bytes.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist

import zcomm

from .._contract import AllGather, Handle, Phase, ReduceScatter


class PlainAllGather(AllGather):
    """Unquantized all-gather over one process group (stage 3's default in both phases)."""

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
        self.group = group
        self.topology = topology

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, unit: Hashable, phase: Phase) -> Handle:
        return zcomm.all_gather_into_tensor(output, input, group=self.group, async_op=True, topology=self.topology)


class PlainReduceScatter(ReduceScatter):
    """Unquantized reduce-scatter over one process group: SUM, then a division by the world
    size in the gradients' dtype once the collective is done (see [Note: gloo and SUM] in
    ``comm._plan``). A bucket of several inputs is one collective over their interleaving
    (``[in0 slice 0, in1 slice 0, ..., in0 slice 1, ...]``), built in a staging buffer from
    ``allocate``, so that this rank's slice of it is the concatenation of the outputs."""

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
        self.group = group
        self.topology = topology

    def __call__(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *, bucket: int) -> Handle:
        world = dist.get_world_size(self.group)
        if len(inputs) == 1:
            staged_in, staged_out = inputs[0], outputs[0]
        else:
            dtype, device = inputs[0].dtype, inputs[0].device
            staged_in = self.allocate(sum(x.numel() for x in inputs), dtype=dtype, device=device)
            torch.cat([x.view(world, -1) for x in inputs], dim=1, out=staged_in.view(world, -1))
            staged_out = self.allocate(staged_in.numel() // world, dtype=dtype, device=device)
        work = zcomm.reduce_scatter_tensor(staged_out, staged_in, op=dist.ReduceOp.SUM, group=self.group,
                                           async_op=True, topology=self.topology)
        return _MeanOnWait(work, staged_in, staged_out, list(outputs), world)


class _MeanOnWait:
    """The plain reduce-scatter's handle: ``wait()`` divides the summed slice by the world
    size and, for a bucket of several outputs, scatters it into them; it keeps the staging
    buffers alive until then."""

    def __init__(self, work: Handle, staged_in: torch.Tensor, staged_out: torch.Tensor,
                 outputs: list[torch.Tensor], world: int) -> None:
        self._work, self._staged_in, self._staged_out = work, staged_in, staged_out
        self._outputs, self._world = outputs, world

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        self._staged_out.div_(self._world)
        if len(self._outputs) > 1:
            parts = self._staged_out.split([o.numel() for o in self._outputs])
            for output, part in zip(self._outputs, parts, strict=True):
                output.copy_(part)
        self._work = self._staged_in = self._staged_out = None
