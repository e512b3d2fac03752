"""Weight differences: stages 1 and 2 send each step's update in 4 (or 8) bits, not the weights.

[Note: weight differences] In stages 1 and 2 every rank holds the whole model in the compute
dtype (a unit's full buffer, the *reference*), and after a step each rank owns the updated
fp32 masters of one shard. Instead of all-gathering the new shard values, each rank sends
the blocked quantization of ``delta = new - reference`` over its shard (``new`` is the
master in the compute dtype, what a plain gather would send), and every rank, the owner
included, sets ``reference = round(reference + dequantize(delta))`` for every shard
(SDP4Bit's weight differences, arXiv 2410.15526). The sum is computed in fp32 from the same
bytes by the same kernel on every rank, so the reference stays identical on every rank,
bit for bit. The owner's fp32 master is never touched: the next step's difference is taken
against the reference, so the quantization error of one step is carried into the next
difference and does not accumulate. The reference's error against the master is one
quantization of one step's difference (plus the rounding to the compute dtype).

A group (``group_size`` elements of one shard) whose difference is too large for its bits
falls back to qwZ for that group only: when the difference's quantization step
``absmax(delta) / qmax`` would exceed the step of INT8 values of the same group,
``absmax(new) / 127`` (qwZ's), the group's new values travel as blocked INT8 values and
replace the group's reference (the flags travel with the differences, so every rank knows
which groups; [Note: fallback slots] says where the values travel). So no group is ever
further from the master than qwZ would leave it, and ``fallback_groups`` counts the groups
that fell back. Reading the largest count of any rank (with the total) is one small host
read per unit and step, after the gather ([Note: host syncs] in ``zero_runtime._host_sync``).
Large steps against small weights fall back (a zero-initialized bias's first steps, Adam's
steps of 1e-2 against weights of 0.02); steps of 1e-4 against the same weights are ten
times below the threshold.

[Note: fallback slots] Each rank's payload carries, after the differences and the flags, the
INT8 values of its first flagged groups, one slot per ``_GROUPS_PER_SLOT`` groups of its shard
(zeros where it flagged fewer), so the few groups that fall back in a typical step
(zero-initialized biases early in training) need no collective of their own: measured on 4
CPU ranks of the bench's GPT in stage 2 without slots, a second gather for a handful of
groups ran for 45 of 48 unit gathers of steps 4-15 and cost a third of the step. Only a rank
that flagged more than its slots sends the rest in a second gather, sized by the largest
such count. A slot is twice an INT4 group, so the slots add under 1% to the differences'
bytes; a shard of fewer groups than one slot's worth has none (its few bytes would grow by
more than they save). The sender finds its first flagged groups by searching the flags'
running count, so no shape depends on the flags and nothing is read on the host before the
send.

The reference must be identical everywhere before a difference may be added to it: the
first gather of each unit, and the first after ``weights_replaced`` (a checkpoint or state
dict load, a resharded load, a ``GatheredParameters`` block), are exact all-gathers of the
new values.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
import torch.distributed as dist

import zcomm
from zcomm.quant import QMAX, QuantSpec, dequantize, payload_nbytes, quantize

from .. import _host_sync
from .._contract import AllGather, Handle, Phase

_INT8_QMAX = QMAX[8]
_GROUPS_PER_SLOT = 256  # groups of a shard per slot for a flagged group's INT8 values ([Note: fallback slots])


class WeightDeltaAllGather(AllGather):
    """Stages 1 and 2's post-step gather of weight differences ([Note: weight differences])."""

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology, *, spec: QuantSpec,
                 exact: AllGather, hierarchical: bool = True) -> None:
        """``hierarchical``: send the differences in qwZ's two hops, inter-node first, synchronously
        (a group spanning nodes with several ranks each); else in one asynchronous all-gather,
        waited for by the handle (a group with one rank per node, as hpZ's block peers)."""
        assert spec.bits in (4, 8), spec
        self.group = group
        self.topology = topology
        self.spec = spec
        self.exact = exact
        self.hierarchical = hierarchical
        self._primed: set[Hashable] = set()
        self.delta_groups = 0  # groups of every rank sent as differences, as seen by this rank
        self.fallback_groups = 0  # groups of every rank sent exactly because their difference was too large

    def weights_replaced(self) -> None:
        self._primed.clear()

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, unit: Hashable, phase: Phase) -> Handle:
        if phase is not Phase.STEP or unit not in self._primed:
            self._primed.add(unit)
            return self.exact(output, input, unit=unit, phase=phase)
        return _DeltaGather(self, output, input)


class _DeltaGather:
    """One unit's difference gather: sent by the constructor (zcomm's hierarchical gather, in two
    hops like qwZ's, or started as one asynchronous gather), applied to the reference by ``wait()``."""

    def __init__(self, owner: WeightDeltaAllGather, output: torch.Tensor, input: torch.Tensor) -> None:
        world, rank = dist.get_world_size(owner.group), dist.get_rank(owner.group)
        numel = input.numel()
        assert output.numel() == world * numel, (output.numel(), world, numel)
        self.owner, self.output, self.input, self.world, self.numel = owner, output, input, world, numel
        bits = owner.spec.bits
        self.group_size = size = owner.spec.group_size_for(numel)
        self.groups = groups = -(-numel // size)
        self.slots = groups // _GROUPS_PER_SLOT
        reference = output[rank * numel:(rank + 1) * numel]
        delta = input.to(torch.float32, copy=True)
        delta.sub_(reference)
        self.flags = _too_large(delta, input, size, groups, QMAX[bits])
        self.payload_nbytes = payload_nbytes(numel, bits, size)
        self.slots_offset = -(-(self.payload_nbytes + groups) // 4) * 4  # the slots' scales word-aligned
        send = torch.empty(self.slots_offset + payload_nbytes(self.slots * size, 8, size), dtype=torch.uint8,
                           device=input.device)
        quantize(delta, bits, size, out=send[:self.payload_nbytes])
        send[self.payload_nbytes:self.payload_nbytes + groups].copy_(self.flags)
        send[self.payload_nbytes + groups:self.slots_offset].zero_()
        if self.slots:
            quantize(self._flagged(0, self.slots).view(-1), 8, size, out=send[self.slots_offset:])
        self.received = torch.empty(world * send.numel(), dtype=torch.uint8, device=input.device)
        self.work = None
        if owner.hierarchical:
            zcomm.all_gather_hierarchical(self.received, send, group=owner.group, topology=owner.topology)
        else:
            self.send = send  # alive until the gather is waited for
            self.work = zcomm.all_gather_into_tensor(self.received, send, group=owner.group, async_op=True,
                                                     topology=owner.topology)
        self.done = False

    def _new_groups(self) -> torch.Tensor:
        """This rank's new values as (groups, group_size), zero-padded, in the input's dtype."""
        return _padded(self.input.view(1, -1), self.groups * self.group_size).view(self.groups, self.group_size)

    def _flagged(self, skip: int, count: int) -> torch.Tensor:
        """The new values (fp32, ``(count, group_size)``) of this rank's flagged groups after its
        first ``skip`` ones, in group order, zeros past its last one: found by a search of the
        flags' running count, so that no shape depends on the flags ([Note: fallback slots])."""
        running = self.flags.cumsum(0)
        wanted = torch.arange(skip + 1, skip + count + 1, device=running.device, dtype=running.dtype)
        positions = torch.searchsorted(running, wanted)
        present = positions < self.groups
        chosen = self._new_groups().index_select(0, positions.clamp(max=self.groups - 1)).float()
        return torch.where(present.unsqueeze(1), chosen, torch.zeros_like(chosen))

    def wait(self) -> None:
        if self.done:
            return
        if self.work is not None:
            self.work.wait()
            self.work = self.send = None
        owner, world, numel, size = self.owner, self.world, self.numel, self.group_size
        rows = self.received.view(world, -1)
        deltas = dequantize(rows[:, :self.payload_nbytes].contiguous(), numel, owner.spec.bits, size, torch.float32)
        updated = deltas.view(world, numel).add_(self.output.view(world, numel))
        flags = rows[:, self.payload_nbytes:self.payload_nbytes + self.groups].bool()
        counts = flags.sum(dim=1)
        most, fallen = _host_sync.read_counts(torch.stack((counts.max(), counts.sum())))  # [Note: host syncs]
        if most:
            groups = _padded(updated, self.groups * size).view(world, self.groups, size)
            updated = self._replace_flagged(groups, rows, flags, most).view(world, -1)
        self.output.view(world, numel).copy_(updated[:, :numel])
        owner.delta_groups += world * self.groups
        owner.fallback_groups += fallen
        self.done, self.received = True, None

    def _replace_flagged(self, groups: torch.Tensor, rows: torch.Tensor, flags: torch.Tensor,
                         most: int) -> torch.Tensor:
        """``groups`` (world, groups, size) with every rank's flagged groups replaced by their INT8
        values: the first ``slots`` of each rank from the payload's slots, the rest (a rank that
        flagged more) from a second gather ([Note: fallback slots]). Selections by masks of
        fixed shape: nothing here waits for the device ([Note: host syncs])."""
        size, slots = self.group_size, self.slots
        order = flags.cumsum(dim=1) - 1  # a flagged group's place among its rank's flagged ones
        if slots:
            in_slots = dequantize(rows[:, self.slots_offset:].contiguous(), slots * size, 8, size, torch.float32)
            groups = _put(groups, flags, order, in_slots.view(self.world, slots, size), 0)
        if most > slots:
            groups = _put(groups, flags, order, self._later_flagged(most - slots), slots)
        return groups

    def _later_flagged(self, count: int) -> torch.Tensor:
        """Every rank's flagged groups past the slots, as qwZ sends values (blocked INT8, one scale
        per group), in group order, padded to ``count`` groups per rank; dequantized to fp32,
        ``(world, count, size)``."""
        owner, size = self.owner, self.group_size
        send = quantize(self._flagged(self.slots, count).view(-1), 8, size)
        received = torch.empty(self.world * send.numel(), dtype=torch.uint8, device=send.device)
        zcomm.all_gather_hierarchical(received, send, group=owner.group, topology=owner.topology)
        values = dequantize(received.view(self.world, -1), count * size, 8, size, torch.float32)
        return values.view(self.world, count, size)


def _put(groups: torch.Tensor, flags: torch.Tensor, order: torch.Tensor, values: torch.Tensor,
         skip: int) -> torch.Tensor:
    """``groups`` (world, groups, size) with each rank's flagged groups of places ``skip`` to
    ``skip + count - 1`` among its flagged ones taken from ``values`` (world, count, size), in order."""
    count = values.shape[1]
    chosen = flags & (order >= skip) & (order < skip + count)
    index = (order - skip).clamp(0, count - 1).unsqueeze(2).expand(-1, -1, groups.shape[2])
    return torch.where(chosen.unsqueeze(2), values.gather(1, index), groups)


def _padded(rows: torch.Tensor, width: int) -> torch.Tensor:
    """``rows`` (2-D) with zero columns appended up to ``width``."""
    if rows.shape[1] == width:
        return rows
    return torch.nn.functional.pad(rows, (0, width - rows.shape[1]))


def _too_large(delta: torch.Tensor, new: torch.Tensor, size: int, groups: int, qmax: int) -> torch.Tensor:
    """Per group (uint8 0/1): the difference's quantization step exceeds INT8 values' step.
    (``new``'s group maxima are taken in its own dtype: abs and max are exact in any.)"""
    width = groups * size
    delta_max = _padded(delta.view(1, -1), width).view(groups, size).abs().amax(dim=1)
    new_max = _padded(new.view(1, -1), width).view(groups, size).abs().amax(dim=1).float()
    return (delta_max * _INT8_QMAX > new_max * qmax).to(torch.uint8)
