"""hpZ with weight differences: stage 3's node-local copies refreshed by INT4 (or INT8) differences.

[Note: hpZ references] With ``zcomm_weight_delta_bits`` in stage 3 (hpZ on), each rank keeps,
for every partitioned unit, a *reference*: the compute-dtype values of its *block peers'*
shards (``zcomm.block_peers_group``: the ranks at its position in every hpZ block, one per
node when blocks are nodes), its own shard included, in peer order. The peers and the
reference are the group and the full buffer of [Note: weight differences] in
``comm._weight_delta``, so every peer holds the same reference bit for bit. A gather of the
unit runs in two hops:

1. *refresh*, only when the shard changed since its reference was last brought up to date
   (the shard tensor and its ``_version``, as for hpZ's secondaries): each peer sends the
   blocked quantization of ``shard - reference[own slot]`` over the peers' group, and every
   peer adds the same dequantized differences to its reference (a group too large for its
   bits falls back to INT8 values for that group only). A unit's first refresh, and the first
   after ``weights_replaced``, sends exact values. With blocks the size of a node this is the
   only hop that crosses nodes; it is asynchronous, waited for in the handle's ``wait``.
2. an exact all-gather of the references over the block (inside the node), into a scratch
   buffer in (block position, peer) order, copied into the unit's full buffer in rank order
   (rank = peer x block size + position). Without a refresh it is started by the call; after
   one, in ``wait``, once the refresh is applied.

Forward and backward both read the references, so they compute with the same weights, whose
error against the master is one quantization of one step's difference rather than qwZ's
INT8 values; a backward gather, an evaluation forward or a later micro-batch's forward of
unchanged weights crosses no node. The references are this mode's hpZ secondaries:
``held_bytes`` counts them, ``1 / partition_size`` of the partitioned parameters in the
compute dtype per rank, kept for the whole run (plain hpZ keeps its secondaries once
allocated too).

Every rank agrees on when to refresh, so the peers' gathers stay matched: shard writes are
the same on every rank (step, loads, ``GatheredParameters``: [Note: gathers follow the
shards] in ``_stage3``), and ``weights_changed`` marks every reference out of date.
Parameters kept whole (stage 3's persistent units) are gathered after each step
(``Phase.STEP``) by a ``WeightDeltaAllGather`` over the whole group, as in stages 1 and 2.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

import zcomm
from zcomm.quant import QuantSpec

from .._contract import AllGather, Handle, Phase
from ._hpz_gather import SecondaryShard, hpz_block_topology
from ._plain import PlainAllGather
from ._weight_delta import WeightDeltaAllGather


class HpzDeltaGather(AllGather):
    """Stage 3's gather in both phases with hpZ and weight differences ([Note: hpZ references])."""

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology, *, partition_size: int,
                 spec: QuantSpec) -> None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.block_topology = hpz_block_topology(topology, rank, partition_size)
        self.block = zcomm.consecutive_group(group, partition_size)
        self.partition_size = partition_size
        self.peers = world // partition_size
        position = rank % partition_size
        peers = zcomm.block_peers_group(group, partition_size)
        peers_topology = topology.of_ranks(range(position, world, partition_size))
        self.refresh = WeightDeltaAllGather(peers, peers_topology, spec=spec, hierarchical=False,
                                            exact=PlainAllGather(peers, peers_topology))
        self.whole = WeightDeltaAllGather(group, topology, spec=spec, exact=PlainAllGather(group, topology))
        self._references: dict[Hashable, SecondaryShard] = {}

    @property
    def delta_groups(self) -> int:
        return self.refresh.delta_groups + self.whole.delta_groups

    @property
    def fallback_groups(self) -> int:
        return self.refresh.fallback_groups + self.whole.fallback_groups

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, unit: Hashable, phase: Phase) -> Handle:
        if phase is Phase.STEP:
            return self.whole(output, input, unit=unit, phase=phase)
        reference = self._references.get(unit)
        if reference is None:
            buffer = self.allocate(self.peers * input.numel(), dtype=input.dtype, device=input.device)
            reference = self._references[unit] = SecondaryShard(buffer, None, 0)
        assert reference.buffer.numel() * self.partition_size == output.numel()
        refresh = None
        if not reference.valid_for(input):
            # Phase.STEP: the refresh sends differences once the unit's reference is primed
            refresh = self.refresh(reference.buffer, input, unit=unit, phase=Phase.STEP)
            reference.source, reference.version = input, input._version
        return _TwoHops(self, refresh, reference.buffer, output)

    def reference(self, unit: Hashable) -> torch.Tensor | None:
        """``unit``'s reference (the block peers' shards in peer order), None before its first gather."""
        reference = self._references.get(unit)
        return None if reference is None else reference.buffer

    def weights_changed(self) -> None:
        for reference in self._references.values():
            reference.source = None

    def weights_replaced(self) -> None:
        self.refresh.weights_replaced()
        self.whole.weights_replaced()

    def held_bytes(self) -> int:
        return sum(r.buffer.numel() * r.buffer.element_size() for r in self._references.values())


class _TwoHops:
    """One gather of [Note: hpZ references]: the refresh (if any), then the block's gather."""

    def __init__(self, owner: HpzDeltaGather, refresh: Handle | None, reference: torch.Tensor,
                 output: torch.Tensor) -> None:
        self.owner, self.refresh, self.reference, self.output = owner, refresh, reference, output
        # one block (no peers across it): the block's gather is already in rank order
        self.scratch = output if owner.peers == 1 else owner.allocate(output.numel(), dtype=output.dtype,
                                                                       device=output.device)
        self.work = None if refresh is not None else self._gather_block()

    def _gather_block(self) -> Handle:
        return zcomm.all_gather_into_tensor(self.scratch, self.reference, group=self.owner.block, async_op=True,
                                            topology=self.owner.block_topology)

    def wait(self) -> None:
        if self.scratch is None:
            return
        if self.refresh is not None:
            self.refresh.wait()
            self.work = self._gather_block()
        self.work.wait()
        owner = self.owner
        if self.scratch is not self.output:
            by_position = self.scratch.view(owner.partition_size, owner.peers, -1)
            self.output.view(owner.peers, owner.partition_size, -1).copy_(by_position.transpose(0, 1))
        self.refresh = self.work = self.scratch = None
