"""Global gradient norm across partitions, and clipping by it.

Each rank holds a disjoint slice of every flat gradient (padding is zero), so the squared
global norm is the sum over ranks of the local squared norms: one all-reduce of one fp64
scalar, which lives on the plan's device (an NCCL group cannot reduce a CPU tensor).
Clipping follows ``torch.nn.utils.clip_grad_norm_`` exactly: the gradients are multiplied
by ``min(max_norm / (norm + 1e-6), 1)`` computed on the device, so a clipped run can be
checked against single-process training and clipping never waits for the GPU (see
[Note: host syncs] in ``_host_sync``). As in torch, a non-finite norm is not special here:
the coefficient is then 0 or nan; only the fp16 dynamic loss scaler detects it and skips
the step (``optimizer``).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .comm._plan import CommPlan


def global_grad_norm(grads: Sequence[torch.Tensor], plan: CommPlan, *, partitioned: bool = True) -> torch.Tensor:
    """The 2-norm of the concatenation of every rank's ``grads`` (inf/nan if any is), as a
    0-dim fp64 tensor on ``plan.device``. ``partitioned`` False: every rank holds the same
    whole gradient (stage 0), whose local norm is the global one, with no collective."""
    local = torch.zeros(1, dtype=torch.float64, device=plan.device)
    for grad in grads:
        local += grad.double().pow(2).sum()
    return (plan.all_reduce_sum(local) if partitioned else local).sqrt()[0]


def clip_by_norm_(grads: Sequence[torch.Tensor], norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place so that their global norm ``norm`` becomes at most ``max_norm``."""
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(coefficient)
