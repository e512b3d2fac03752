"""Stage 3: when each partitioned unit is gathered, prefetched, kept and freed.

A unit is FREE (storage resized to 0), GATHERING (an all-gather handle is in flight) or
READY. A *use* of a unit starts when a forward acquires it with no other forward user
holding it (``acquire``; nested users only count references) or when backward first
needs it (``need_for_backward``, on the gradient of an output of a module that used it).
A forward use ends when the last forward user releases it; a backward use when the
unit's parameter gradients have all been accumulated (``grads_ready``). When a use ends,
the unit is freed or kept gathered (see [Note: stage-3 residency]); ``end_backward`` frees
whatever is still gathered. Persistent parameters (``stage3_param_persistence_threshold``)
are in units the scheduler never sees: they are always whole.

[Note: stage-3 prefetch] The first training step records the trace of uses, forward and
backward in order (a tied embedding used again by the LM head appears twice in forward);
forward passes without autograd (evaluation) are neither recorded nor traced. From then
on each use moves a cursor to that unit's next position in the trace, and the prefetcher
walks a front along the trace from there, starting the gathers of the FREE units it meets
while fewer than ``stage3_prefetch_bucket_size`` elements are being gathered ahead of their
use and the live elements stay within ``stage3_max_live_parameters``. It never walks past
the end of the step: the next step's weights do not exist yet. The prefetches are issued
*before* waiting for the current unit's own gather, so the next units' gathers, qwZ's
quantization included, are queued while unit i's bytes are on the wire (ZeRO++ section
4.1.1; see [Note: quantize early] in ``comm._quantized``). Prefetching and residency only
change *when* a unit is gathered, never its inputs, so results are identical with them on
or off (see the next Note). Every rank records the same trace (same model, same control
flow), so the collectives stay matched across ranks.

[Note: gathers follow the shards] A gathered buffer remembers the shard version
(``tensor._version``) its gather read (``FlatUnit.mark_gathered``). A use that finds its unit
gathered from an older version (a prefetch issued, or a unit kept, before an in-place write
to the shards between a forward and its backward) gathers it again before the module runs,
and a stale buffer leaves no hpZ secondary behind when it is freed. Without this, whether a
backward saw such a write would depend on whether the prefetch window happened to reach that
unit, or, for a gather still in flight on gloo's worker thread, on timing. A write in flight
with a gather only spoils that gather's result, which is discarded. Shard writes are the same
on every rank (optimizer step, checkpoint and state-dict loads, ``GatheredParameters``), so
the ranks agree on which units to gather again and the collectives stay matched.

[Note: stage-3 residency] When a use of a unit ends, the unit stays gathered (DeepSpeed's
rules) if its next use in this step is near and no more than ``stage3_max_live_parameters``
elements are live. Near means: fewer than ``stage3_max_reuse_distance`` parameter elements
are used in the trace between now and then (counting every use, as DeepSpeed counts every
module's parameters), or the prefetch front has already passed that use: it found the unit
gathered and moved on, so freeing it would only make that use gather it on demand (while
kept it counts in the window: see the next Note). A small reuse distance therefore frees
after each use only what lies beyond the prefetch window. With DeepSpeed's defaults (1e9
each) a model under ~5e8 parameters keeps every unit from its forward use to its backward
use, so backward gathers nothing: stage 3 then moves the traffic of stage 2 plus one
forward gather. A unit kept after forward is not freed there,
so hpZ takes no secondary of it (backward does not gather it), and with qwZ its backward
computes with the same INT8-gathered weights as its forward, as it does with hpZ.

[Note: the window holds kept units] A unit kept for a use the front has passed is gathered
ahead of that use, so it counts in the prefetch window (``_ahead``) until the use comes, as a
prefetched unit does until its gather is waited for. Otherwise each unit kept so widens the
window by its size: at the turn from forward to backward the last forward units (whose
backward uses come next) are kept while the front gathers ``d`` units' worth beyond them, and
a stack of 8 equal units at depth 4 held 6 gathered in forward and 7 at the turn, where the
window allows the unit in use and 4 more (tests/runtime/test_prefetch_memory.py).
"""

from __future__ import annotations

import bisect
from typing import Iterable, NamedTuple, Sequence

import torch

from ._contract import Phase
from ._partition import FlatUnit, GatherState
from .comm._plan import CommPlan
from .offload._params import ParamOffload


class Use(NamedTuple):
    unit: FlatUnit
    phase: Phase


class Trace:
    """The uses of one training step in order, indexed for the scheduler's look-ups."""

    def __init__(self, uses: Sequence[Use]) -> None:
        self.uses = tuple(uses)
        # keyed by (unit index, forward?): an Enum's hash is a Python call, and find runs per use
        self._by_phase: dict[tuple[int, bool], list[int]] = {}
        self._by_unit: dict[int, list[int]] = {}
        self._elements = [0]  # _elements[i]: elements of uses[:i]
        for position, (unit, phase) in enumerate(self.uses):
            self._by_phase.setdefault((unit.index, phase is Phase.FORWARD), []).append(position)
            self._by_unit.setdefault(unit.index, []).append(position)
            self._elements.append(self._elements[-1] + unit.layout.numel)

    def find(self, unit: FlatUnit, phase: Phase, start: int) -> int | None:
        """The first position >= ``start`` of ``unit`` used in ``phase``, else its first
        (a new pass), else None (not in the trace)."""
        positions = self._by_phase.get((unit.index, phase is Phase.FORWARD))
        if not positions:
            return None
        i = bisect.bisect_left(positions, start)
        return positions[i] if i < len(positions) else positions[0]

    def next_use(self, unit: FlatUnit, after: int) -> int | None:
        """The first position > ``after`` of ``unit`` in either phase (this step only)."""
        positions = self._by_unit.get(unit.index, [])
        i = bisect.bisect_right(positions, after)
        return positions[i] if i < len(positions) else None

    def elements_between(self, start: int, stop: int) -> int:
        """Elements of the uses strictly between positions ``start`` and ``stop``."""
        return self._elements[stop] - self._elements[start + 1]


class ParamScheduler:
    def __init__(self, *, units: Sequence[FlatUnit], plan: CommPlan, prefetch_numel: int, max_live: int,
                 max_reuse_distance: int, offload: ParamOffload | None = None) -> None:
        """``offload``: where the shards live between uses (``offload_param``; see [Note:
        shard residency] in ``offload._params``), None when they stay on the device."""
        assert all(unit.partitioned for unit in units)
        self.units = list(units)
        self.plan = plan
        self.offload = offload
        self.prefetch_numel = prefetch_numel
        self.max_live = max_live
        self.max_reuse_distance = max_reuse_distance
        self.trace: Trace | None = None
        self._recording: list[Use] | None = []  # the first training step's uses
        self._cursor = -1  # trace position of the latest use
        self._front = 0  # next trace position the prefetcher looks at
        self._read_front = 0  # next trace position whose shard read (offload_param nvme) may start
        self.live = 0  # elements of units gathering or gathered
        self._ahead = 0  # elements being gathered ahead of their use
        self.prefetches = 0  # gathers issued ahead of need, for tests and reports
        self.kept = 0  # uses that ended with the unit kept gathered, for tests and reports

    def acquire(self, unit: FlatUnit) -> None:
        """A forward user needs ``unit`` now."""
        if unit.refs == 0:
            self._begin_use(unit, Phase.FORWARD, traced=torch.is_grad_enabled())
        unit.refs += 1

    def release(self, unit: FlatUnit) -> None:
        assert unit.refs > 0
        unit.refs -= 1
        if unit.refs == 0 and not unit.in_backward:
            self._end_use(unit, after_forward=True)

    def need_for_backward(self, units: Iterable[FlatUnit]) -> None:
        """Backward reached an output of a module call that used ``units``: gather those whose
        backward use is not over. A frozen unit counts the calls holding it (a module called
        twice in a row is needed by the first call's backward after the second's is done)."""
        for unit in units:
            if unit.frozen:
                unit.backward_holds += 1
            if (unit.frozen or unit.grads_seen < unit.grad_params) and not unit.in_backward:
                self._begin_use(unit, Phase.BACKWARD, traced=True)
                unit.in_backward = True

    def frozen_backward_done(self, unit: FlatUnit) -> None:
        """A call holding frozen ``unit`` finished its backward; the last one ends the use."""
        assert unit.frozen and unit.backward_holds > 0
        unit.backward_holds -= 1
        if unit.backward_holds == 0 and unit.in_backward:
            self.grads_ready(unit)

    def grads_ready(self, unit: FlatUnit) -> None:
        """The backward use of ``unit`` is over: its gradients are all accumulated, or (a
        frozen unit) every call that used it has its input gradients."""
        unit.in_backward = False
        if unit.refs == 0:
            self._end_use(unit, after_forward=False)

    def end_backward(self) -> None:
        """The training step's backward is over: the first one ends the recording."""
        if self._recording is not None:
            self.trace = Trace(self._recording)
            self._recording = None
        self._cursor, self._front, self._read_front = -1, 0, 0
        self.free_all()

    def free_all(self) -> None:
        """Free every gathered unit (end of backward; before the weights change), except
        those a ``GatheredParameters`` block pins (see [Note: pinned units] in ``_gathered``)."""
        for unit in self.units:
            unit.refs = 0
            unit.in_backward = False
            unit.backward_holds = 0
            if unit.state is not GatherState.FREE and not unit.pinned:
                self._free(unit, after_forward=False)

    def wait(self, unit: FlatUnit) -> None:
        """Finish ``unit``'s gather in flight (``GatheredParameters``)."""
        assert unit.state is GatherState.GATHERING
        self._wait(unit)

    # ----- uses -----
    def _begin_use(self, unit: FlatUnit, phase: Phase, *, traced: bool) -> None:
        """Gather ``unit`` if it is not resident; a traced use also moves the cursor and prefetches."""
        unit.use_position = self._locate(unit, phase) if traced else None
        if unit.state is GatherState.FREE:
            self._start(unit, phase, ahead=False)
        if unit.use_position is not None:
            self._prefetch()
        if unit.state is GatherState.GATHERING:
            self._wait(unit)
        elif unit.prefetched:  # kept inside the window: its use has come ([Note: the window holds kept units])
            self._arrived(unit)
        if unit.gathered_is_stale() and not unit.pinned:
            self._regather(unit, phase)

    def _locate(self, unit: FlatUnit, phase: Phase) -> int | None:
        """Record the use (first step) or find it in the trace and move the cursor there."""
        if self._recording is not None:
            self._recording.append(Use(unit, phase))
            return None
        position = self.trace.find(unit, phase, self._cursor + 1)
        if position is None:
            return None
        if position <= self._cursor:  # the control flow went back (a pass ended without backward)
            self._front = self._read_front = 0
        self._cursor = position
        return position

    def _end_use(self, unit: FlatUnit, *, after_forward: bool) -> None:
        """Keep ``unit`` gathered or free it (see [Note: stage-3 residency]); a pinned unit
        stays gathered outside the accounting."""
        if unit.pinned:
            return
        upcoming = self._kept_for(unit)
        if upcoming is None:
            self._free(unit, after_forward=after_forward)
            return
        self.kept += 1
        if upcoming < self._front and not unit.prefetched:  # [Note: the window holds kept units]
            unit.prefetched = True
            self._ahead += unit.layout.numel

    def _kept_for(self, unit: FlatUnit) -> int | None:
        """The trace position of the next use ``unit`` is kept gathered for, else None (free it)."""
        if unit.use_position is None or self.live > self.max_live:  # untraced, or over the limit
            return None
        upcoming = self.trace.next_use(unit, self._cursor)
        if upcoming is None:
            return None
        near = upcoming < self._front or self.trace.elements_between(self._cursor, upcoming) < self.max_reuse_distance
        return upcoming if near else None

    # ----- gathers -----
    def _prefetch(self) -> None:
        """See [Note: stage-3 prefetch]."""
        self._front = max(self._front, self._cursor + 1)
        uses = self.trace.uses
        while self._front < len(uses) and self._ahead < self.prefetch_numel:
            unit, phase = uses[self._front]
            if unit.state is GatherState.FREE:
                if self.live + unit.layout.numel > self.max_live:
                    break
                if self.offload is not None and not self.offload.on_its_way(unit):
                    break  # its shard is on NVMe: its read starts below, its gather on a later use
                self._start(unit, phase, ahead=True)
                self.prefetches += 1
            self._front += 1
        self._read_ahead()

    def _read_ahead(self) -> None:
        """Start the shard reads of the units past the prefetch front (see [Note: parameter
        swap buffers] in ``offload._params``), so they overlap compute rather than delay gathers."""
        if self.offload is None:
            return
        uses = self.trace.uses
        self._read_front = max(self._read_front, self._front)
        while self._read_front < len(uses) and self.offload.prefetch(uses[self._read_front].unit):
            self._read_front += 1

    def _start(self, unit: FlatUnit, phase: Phase, *, ahead: bool) -> None:
        if self.offload is not None:
            self.offload.fetch(unit)
        unit.alloc_full()
        self._issue(unit, phase)
        unit.prefetched = ahead
        self.live += unit.layout.numel
        if ahead:
            self._ahead += unit.layout.numel

    def _issue(self, unit: FlatUnit, phase: Phase) -> None:
        gather = self.plan.forward_gather if phase is Phase.FORWARD else self.plan.backward_gather
        unit.mark_gathered()
        unit.handle = gather(unit.full, unit.shard, unit=unit.index, phase=phase)
        unit.state = GatherState.GATHERING

    def _regather(self, unit: FlatUnit, phase: Phase) -> None:
        """See [Note: gathers follow the shards]."""
        self._issue(unit, phase)
        self._wait(unit)

    def _wait(self, unit: FlatUnit) -> None:
        unit.handle.wait()
        unit.handle = None
        unit.state = GatherState.READY
        if unit.prefetched:
            self._arrived(unit)

    def _arrived(self, unit: FlatUnit) -> None:
        """``unit``, counted in the prefetch window, leaves it: its use came, or it is freed."""
        unit.prefetched = False
        self._ahead -= unit.layout.numel

    def _free(self, unit: FlatUnit, *, after_forward: bool) -> None:
        if unit.state is GatherState.GATHERING:
            self._wait(unit)
        elif unit.prefetched:
            self._arrived(unit)
        if after_forward and not unit.gathered_is_stale():
            for gather in self.plan.gathers():
                gather.after_forward(unit.full, unit.shard, unit=unit.index)
        unit.free_full()
        if self.offload is not None:
            self.offload.evict(unit)
        self.live -= unit.layout.numel
