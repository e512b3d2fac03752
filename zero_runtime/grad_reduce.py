"""Gradient partitioning: grad hooks, flat gradient buckets and their reduce-scatter.

Every trainable parameter gets a post-accumulate-grad hook. It adds ``param.grad`` into its
unit's flat gradient buffer and drops ``param.grad``. Stages 2 and 3 launch the unit's
reduce-scatter (async) as soon as its last parameter's gradient arrived, so communication
overlaps the rest of backward; stage 1 keeps full gradients and reduce-scatters them once per
optimizer step, at the end of the accumulation boundary's backward. ``finish`` launches what
is left, in unit order so every rank issues the same collectives in the same order, waits
for all handles, and folds each rank's reduced slice (divided by the world size: the
gradient of the global-batch mean) into ``grad_shard``.

[Note: hook ordering] autograd runs a leaf's AccumulateGrad node once per backward, after all
uses of the parameter contributed (a tied embedding and LM head sum first), so "all of a
unit's hooks fired" means no later autograd node reads those parameters or gradients. Stage 3
relies on this to free a unit's gathered parameters from ``on_unit_ready``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .comm import CommPlan, Handle
from .partition import FlatUnit


class GradReducer:
    def __init__(self, *, units: Sequence[FlatUnit], plan: CommPlan, stage: int,
                 on_unit_ready: Callable[[FlatUnit], None] | None = None) -> None:
        self.units = list(units)
        self.plan = plan
        self.eager = stage >= 2
        self.keep_full_grads = stage == 1
        self.on_unit_ready = on_unit_ready
        self._launched: set[int] = set()
        self._pending: list[tuple[FlatUnit, Handle, torch.Tensor]] = []
        self._hooks = []
        for unit in self.units:
            if self.keep_full_grads:
                unit.full_grad = unit.new_full_grad()
            for slot_index, param in enumerate(unit.params):
                if param.requires_grad:
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._hook(unit, slot_index)))

    def _hook(self, unit: FlatUnit, slot_index: int) -> Callable[[torch.Tensor], None]:
        slot = unit.layout.slots[slot_index]

        def accumulate(param: torch.Tensor) -> None:
            if unit.full_grad is None:
                unit.full_grad = unit.new_full_grad()
            unit.full_grad[slot.offset : slot.offset + slot.numel].view(slot.shape).add_(param.grad)
            param.grad = None
            unit.grads_seen += 1
            if unit.grads_seen == unit.grad_params:
                if self.on_unit_ready is not None:
                    self.on_unit_ready(unit)
                if self.eager:
                    self._launch(unit)
        return accumulate

    def _launch(self, unit: FlatUnit) -> None:
        assert unit.index not in self._launched, "a unit's gradients were reduced twice in one backward"
        if unit.full_grad is None:
            unit.full_grad = unit.new_full_grad()
        out = torch.empty_like(unit.grad_shard)
        self._pending.append((unit, self.plan.reduce_scatter.reduce_scatter(out, unit.full_grad, unit=unit.index), out))
        self._launched.add(unit.index)

    def finish(self, *, reduce: bool) -> None:
        """End of a backward: with ``reduce``, reduce every unit not yet reduced; then wait and
        accumulate. Stage 1 passes ``reduce=False`` on non-boundary micro-steps."""
        if reduce:
            for unit in self.units:
                if unit.index not in self._launched:
                    self._launch(unit)
        world = self.plan.world_size
        for unit, handle, out in self._pending:
            handle.wait()
            unit.grad_shard.add_(out.div_(world))
            if self.keep_full_grads:
                unit.full_grad.zero_()
            else:
                unit.full_grad = None
        self._pending.clear()
        self._launched.clear()
        for unit in self.units:
            unit.grads_seen = 0

    def discard(self) -> None:
        """Forget accumulated gradients (``zero_grad``); nothing may be in flight."""
        assert not self._pending
        for unit in self.units:
            unit.grad_shard.zero_()
            unit.grads_seen = 0
            if self.keep_full_grads:
                unit.full_grad.zero_()
            else:
                unit.full_grad = None
