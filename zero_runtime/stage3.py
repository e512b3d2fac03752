"""Stage 3: when each unit's parameters are gathered, prefetched and freed.

A unit is FREE (storage resized to 0), GATHERING (an all-gather handle is in flight) or
READY. Forward users hold references (``acquire``/``release``); the unit is freed when the
last forward user is done, unless backward still needs it. In backward a unit is gathered
when the gradient of an output of a module that used it arrives (``need_for_backward``) and
freed when its parameters' gradients have all been accumulated (``grads_ready``).
``end_backward`` frees whatever is still gathered.

[Note: prefetch] The first iteration records, per phase, the order in which units are first
gathered. From then on, gathering unit i also starts the async gathers of the units that
follow it in the recorded order, up to ``prefetch_numel`` elements, so their communication
overlaps the current module's compute. Prefetching only changes *when* a gather is issued,
never its inputs, so results are identical with it on or off. Every rank records the same
order (same model, same control flow), so the collectives stay matched across ranks.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from .comm import CommPlan, Phase
from .partition import FlatUnit, GatherState


class ParamScheduler:
    def __init__(self, *, units: Sequence[FlatUnit], plan: CommPlan, prefetch_numel: int) -> None:
        self.units = list(units)
        self.plan = plan
        self.prefetch_numel = prefetch_numel
        self.recording = True
        self.order: dict[Phase, list[FlatUnit]] = {Phase.FORWARD: [], Phase.BACKWARD: []}
        self.prefetches = 0  # gathers issued ahead of need, for tests and reports
        self._position: dict[Phase, dict[int, int]] = {Phase.FORWARD: {}, Phase.BACKWARD: {}}

    def acquire(self, unit: FlatUnit) -> None:
        """A forward user needs ``unit`` now."""
        self._ensure(unit, Phase.FORWARD)
        unit.refs += 1

    def release(self, unit: FlatUnit) -> None:
        assert unit.refs > 0
        unit.refs -= 1
        if unit.refs == 0 and not unit.in_backward:
            self._free(unit, after_forward=True)

    def need_for_backward(self, units: Iterable[FlatUnit]) -> None:
        for unit in units:
            if unit.grad_params and unit.grads_seen < unit.grad_params:
                self._ensure(unit, Phase.BACKWARD)
                unit.in_backward = True

    def grads_ready(self, unit: FlatUnit) -> None:
        unit.in_backward = False
        if unit.refs == 0:
            self._free(unit, after_forward=False)

    def end_backward(self) -> None:
        self.recording = False
        self.free_all()

    def free_all(self) -> None:
        """Free every gathered unit (end of backward; before the weights change)."""
        for unit in self.units:
            unit.refs = 0
            unit.in_backward = False
            if unit.state is not GatherState.FREE:
                self._free(unit, after_forward=False)

    def _ensure(self, unit: FlatUnit, phase: Phase) -> None:
        if unit.state is GatherState.FREE:
            self._start(unit, phase)
        if unit.state is GatherState.GATHERING:
            unit.handle.wait()
            unit.handle = None
            unit.state = GatherState.READY
        self._record_and_prefetch(unit, phase)

    def _start(self, unit: FlatUnit, phase: Phase) -> None:
        unit.alloc_full()
        gather = self.plan.forward_gather if phase is Phase.FORWARD else self.plan.backward_gather
        unit.handle = gather.gather(unit.full, unit.shard, unit=unit.index, phase=phase)
        unit.state = GatherState.GATHERING

    def _free(self, unit: FlatUnit, *, after_forward: bool) -> None:
        if unit.state is GatherState.GATHERING:
            unit.handle.wait()
            unit.handle = None
        if after_forward:
            for gather in self.plan.gathers():
                gather.after_forward(unit.full, unit=unit.index)
        unit.free_full()

    def _record_and_prefetch(self, unit: FlatUnit, phase: Phase) -> None:
        position = self._position[phase]
        if self.recording:
            if unit.index not in position:
                position[unit.index] = len(self.order[phase])
                self.order[phase].append(unit)
            return
        if self.prefetch_numel == 0 or unit.index not in position:
            return
        budget = self.prefetch_numel
        for nxt in self.order[phase][position[unit.index] + 1 :]:
            budget -= nxt.layout.numel
            if budget < 0:
                break
            if nxt.state is GatherState.FREE:
                self._start(nxt, phase)
                self.prefetches += 1
