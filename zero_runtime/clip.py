"""Global gradient norm across partitions, and clipping by it.

Each rank holds a disjoint slice of every flat gradient (padding is zero), so the squared
global norm is the sum over ranks of the local squared norms: one all-reduce of one scalar.
The clip coefficient follows ``torch.nn.utils.clip_grad_norm_`` exactly
(``max_norm / (norm + 1e-6)``, applied only when below 1) so a clipped run can be checked
against single-process training.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .comm import CommPlan


def global_grad_norm(grads: Sequence[torch.Tensor], plan: CommPlan) -> torch.Tensor:
    """The 2-norm of the concatenation of every rank's ``grads`` (inf/nan if any is)."""
    local = torch.zeros(1, dtype=torch.float64)
    for grad in grads:
        local += grad.double().pow(2).sum()
    return plan.all_reduce_sum(local).sqrt()[0]


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> float:
    """Factor to multiply gradients by so their global norm is at most ``max_norm``."""
    coef = max_norm / (float(norm) + 1e-6)
    return min(coef, 1.0)
