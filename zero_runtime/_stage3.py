"""Stage 3: when each unit's parameters are gathered, prefetched and freed.

A unit is FREE (storage resized to 0), GATHERING (an all-gather handle is in flight) or
READY. Forward users hold references (``acquire``/``release``); the unit is freed when the
last forward user is done, unless backward still needs it. In backward a unit is gathered
when the gradient of an output of a module that used it arrives (``need_for_backward``) and
freed when its parameters' gradients have all been accumulated (``grads_ready``).
``end_backward`` frees whatever is still gathered.

[Note: stage-3 prefetch] The first iteration records, per phase, the trace of gathers: every unit
each time it has to be gathered (a tied embedding gathered again for the LM head appears
twice). From then on, each gather of a unit moves that phase's cursor to the unit's next
occurrence in the trace (wrapping around at the start of a new pass) and starts the async
gathers of the units that follow it there, up to ``prefetch_numel`` elements, so their
communication overlaps the current module's compute. Following the trace rather than each
unit's first position keeps a repeated use from prefetching the whole model a second time.
The prefetches are issued *before* waiting for the current unit's own gather, so the next
units' gathers, qwZ's quantization included, are queued while unit i's bytes are on the wire
(ZeRO++ section 4.1.1; see [Note: quantize early] in ``_quantized_comm``). Prefetching only
changes *when* a gather is issued, never its inputs, so results are identical with it on or
off. Every rank records the same trace (same model, same control flow), so the collectives
stay matched across ranks.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from ._api import Phase
from ._comm_plan import CommPlan
from ._partition import FlatUnit, GatherState


class ParamScheduler:
    def __init__(self, *, units: Sequence[FlatUnit], plan: CommPlan, prefetch_numel: int) -> None:
        self.units = list(units)
        self.plan = plan
        self.prefetch_numel = prefetch_numel
        self.recording = True
        self.trace: dict[Phase, list[FlatUnit]] = {Phase.FORWARD: [], Phase.BACKWARD: []}
        self.prefetches = 0  # gathers issued ahead of need, for tests and reports
        self._cursor: dict[Phase, int] = {Phase.FORWARD: 0, Phase.BACKWARD: 0}

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
        if unit.state is GatherState.READY:
            return
        if unit.state is GatherState.FREE:
            self._start(unit, phase)
        self._trace_and_prefetch(unit, phase)
        unit.handle.wait()
        unit.handle = None
        unit.state = GatherState.READY

    def _start(self, unit: FlatUnit, phase: Phase) -> None:
        unit.alloc_full()
        gather = self.plan.forward_gather if phase is Phase.FORWARD else self.plan.backward_gather
        unit.handle = gather(unit.full, unit.shard, unit=unit.index, phase=phase)
        unit.state = GatherState.GATHERING

    def _free(self, unit: FlatUnit, *, after_forward: bool) -> None:
        if unit.state is GatherState.GATHERING:
            unit.handle.wait()
            unit.handle = None
        if after_forward:
            for gather in self.plan.gathers():
                gather.after_forward(unit.full, unit.shard, unit=unit.index)
        unit.free_full()

    def _trace_and_prefetch(self, unit: FlatUnit, phase: Phase) -> None:
        """``unit`` is needed and not resident: record it (first step) or prefetch what follows it."""
        trace = self.trace[phase]
        if self.recording:
            trace.append(unit)
            return
        position = _next_occurrence(trace, unit, self._cursor[phase])
        if position is None or self.prefetch_numel == 0:
            return
        self._cursor[phase] = position + 1
        budget = self.prefetch_numel
        for nxt in trace[position + 1 :]:
            budget -= nxt.layout.numel
            if budget < 0:
                break
            if nxt.state is GatherState.FREE:
                self._start(nxt, phase)
                self.prefetches += 1


def _next_occurrence(trace: Sequence[FlatUnit], unit: FlatUnit, start: int) -> int | None:
    """The first index >= ``start`` holding ``unit``, else the first before it, else None."""
    for positions in (range(start, len(trace)), range(min(start, len(trace)))):
        for position in positions:
            if trace[position] is unit:
                return position
    return None
