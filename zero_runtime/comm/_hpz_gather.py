"""hpZ: hierarchical partitioning of the stage-3 parameters (ZeRO++ section 3.2).

Forward gathers a unit's parameters from the primary partition (its shards over all ranks).
When the module's forward is done and the full buffer is about to be freed, each rank keeps
a *secondary* shard of it: its slice of the full buffer over the block of
``partition_size`` consecutive ranks that holds it (normally the ranks of one node). Backward
gathers the unit again from those secondaries over the block's own process group, so with
blocks the size of a node backward all-gathers never cross nodes. The secondary holds
whatever forward computed with (with qwZ, the dequantized INT8 weights), so forward and
backward see the same parameters, and costs ``2 x params / partition_size`` bytes in bf16
(``held_bytes``; the buffers are kept once allocated so memory stays flat across steps).
A unit the scheduler keeps gathered from forward to backward (DeepSpeed's reuse distance,
see [Note: stage-3 residency] in ``_stage3``) is not freed after forward and not gathered
in backward, so it takes no secondary: hpZ acts on the units that are freed in between.

[Note: secondary validity] A secondary is valid for the shard tensor and shard version
(``tensor._version``, bumped by every in-place write) it was taken from. The optimizer step,
``load_checkpoint`` and ``load_state_dict`` all end in ``weights_changed``, which invalidates
every secondary; a direct in-place write to a shard between a forward and its backward is
caught by the version check. A backward gather whose secondary is not valid gathers from the
primary partition instead (``primary_fallbacks`` counts these), so a stale secondary is never
read: the result is exactly what plain stage 3 computes.

[Note: fill/gather ordering] A secondary is written (``after_forward``) and read (its unit's
backward gather) only through its own unit, and the ``ParamScheduler`` keeps at most one
gather per unit in flight and waits for it before freeing the unit, which is where
``after_forward`` runs. So a fill never overlaps a gather that reads the same buffer (the
race DeepSpeed's hpZ had); ``_in_flight`` asserts it, and that ``weights_changed`` runs with
nothing in flight. A fill is complete before a later gather reads it: on CPU the copy is
synchronous, on CUDA the copy and the collective are issued in that order from this thread
and NCCL's stream waits for the current stream.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
import torch.distributed as dist

import zcomm

from .._contract import AllGather, Handle, Phase


def hpz_block_topology(topology: zcomm.Topology, rank: int, partition_size: int) -> zcomm.Topology:
    """The node layout of the hpZ block (``partition_size`` consecutive ranks) holding ``rank``.

    Derived from ``topology``, so ``zcomm.comm_stats`` counts the block's bytes as intra- or
    inter-node by where its ranks really are. Raises ``ValueError`` unless the size divides the
    world and blocks line up with nodes (it divides the node's ``local_size`` or is a multiple of it).
    """
    world_size, local_size = topology.world_size, topology.local_size
    if partition_size < 1 or world_size % partition_size:
        raise ValueError(f"zero_hpz_partition_size {partition_size} must divide the world size {world_size}")
    if local_size % partition_size and partition_size % local_size:
        raise ValueError(f"zero_hpz_partition_size {partition_size} must divide the ranks per node (local_size "
                         f"{local_size}) or be a multiple of it, so that its blocks of consecutive ranks line up "
                         "with nodes")
    start = rank // partition_size * partition_size
    return topology.of_ranks(range(start, start + partition_size))


@dataclass
class SecondaryShard:
    buffer: torch.Tensor
    source: torch.Tensor | None  # the shard tensor it was taken from; None = invalidated
    version: int

    def valid_for(self, shard: torch.Tensor) -> bool:
        return self.source is shard and shard._version == self.version


class _Tracked:
    """A gather's handle that tells the ``HpzGather`` when its secondary is no longer read."""

    def __init__(self, work: Handle, done: Callable[[], None]) -> None:
        self._work = work
        self._done = done

    def wait(self) -> object:
        result = self._work.wait()
        self._done()
        return result


class HpzGather(AllGather):
    """hpZ's backward ``AllGather``: secondary shards over blocks of consecutive ranks."""

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology, *, partition_size: int,
                 primary: AllGather) -> None:
        rank = dist.get_rank(group)
        self.block_topology = hpz_block_topology(topology, rank, partition_size)
        self.block = zcomm.consecutive_group(group, partition_size)
        self.partition_size = partition_size
        self.block_rank = rank % partition_size
        self.primary = primary
        self.primary_fallbacks = 0
        self._secondaries: dict[Hashable, SecondaryShard] = {}
        self._in_flight: set[Hashable] = set()

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, unit: Hashable, phase: Phase) -> Handle:
        secondary = self._secondaries.get(unit)
        if secondary is None or not secondary.valid_for(input):
            self.primary_fallbacks += 1
            return self.primary(output, input, unit=unit, phase=phase)
        assert unit not in self._in_flight, "two gathers of one unit in flight"
        self._in_flight.add(unit)
        work = zcomm.all_gather_into_tensor(output, secondary.buffer, group=self.block, async_op=True,
                                            topology=self.block_topology)
        return _Tracked(work, lambda: self._in_flight.discard(unit))

    def after_forward(self, full: torch.Tensor, shard: torch.Tensor, *, unit: Hashable) -> None:
        assert unit not in self._in_flight, "a secondary was refilled while a gather reads it"
        numel = full.numel() // self.partition_size
        mine = full[self.block_rank * numel : (self.block_rank + 1) * numel]
        secondary = self._secondaries.get(unit)
        if secondary is None:
            buffer = self.allocate(numel, dtype=full.dtype, device=full.device)
            secondary = self._secondaries[unit] = SecondaryShard(buffer, None, 0)
        assert secondary.buffer.numel() == numel
        secondary.buffer.copy_(mine)
        secondary.source, secondary.version = shard, shard._version

    def weights_changed(self) -> None:
        assert not self._in_flight, "weights changed while a secondary was being gathered"
        for secondary in self._secondaries.values():
            secondary.source = None

    def held_bytes(self) -> int:
        return sum(s.buffer.numel() * s.buffer.element_size() for s in self._secondaries.values())
