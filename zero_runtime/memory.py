"""``memory_report()``: the model-state bytes this rank holds, by category.

Counts persistent tensors only (what the ZeRO paper's formulas describe): the compute-dtype
parameters this rank keeps (full buffers in stages 1-2, its shard in stage 3), its gradient
buffers (full in stage 1, its reduced shard in stages 2-3) and its optimizer states (fp32
master shard plus every tensor in the torch optimizer's state), and the parameter copies the
communication objects keep between uses (hpZ's secondary partition). Transient buffers (a stage-3
unit gathered for one module, a gradient bucket in flight) are bounded by the bucket sizes
and not counted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .engine import ZeroOptimizer


class MemoryReport(NamedTuple):
    parameters: int
    gradients: int
    optimizer_states: int
    secondary_parameters: int = 0  # copies kept by the gather objects (hpZ), 0 without ZeRO++

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.secondary_parameters


def measure(opt: "ZeroOptimizer") -> MemoryReport:
    stage3 = opt.config.stage == 3
    params = sum(_nbytes(u.shard) if stage3 else u.full_nbytes for u in opt.units)
    grads = sum(_nbytes(u.full_grad) if opt.config.stage == 1 else _nbytes(u.grad_shard) for u in opt.units)
    states = sum(_nbytes(u.master) for u in opt.units)
    for state in opt.optimizer.state.values():
        states += sum(_nbytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    secondary = sum(gather.held_bytes() for gather in opt.plan.gathers())
    return MemoryReport(parameters=params, gradients=grads, optimizer_states=states, secondary_parameters=secondary)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
