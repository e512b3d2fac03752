"""DeepSpeed's learning-rate schedules ``WarmupLR``, ``WarmupDecayLR`` and ``WarmupCosineLR``.

These are the schedules a DeepSpeed config's ``scheduler`` section names; ``initialize``
builds one over the optimizer of the fp32 master shards and ``ZeroOptimizer.step`` steps it
after every applied optimizer step (not after a skipped fp16 overflow step, not between
accumulation micro-steps), as DeepSpeed's engine does. They follow DeepSpeed's definitions
(``deepspeed/runtime/lr_schedules.py``) step for step:

* the schedule's iteration counter ``last_batch_iteration`` starts at -1; building the
  schedule writes the learning rate of iteration -1 into the optimizer (``warmup_min_lr``,
  or 0 for ``WarmupCosineLR``), so the first optimizer step runs at that rate, and each
  ``step()`` advances the counter by one and writes the new rate;
* warm-up over ``warmup_num_steps`` (at least 2) iterations ``i``: ``"log"`` (the default)
  scales by ``log(i + 1) / log(warmup_num_steps)``, ``"linear"`` by ``i / warmup_num_steps``;
* ``WarmupLR`` then stays at ``warmup_max_lr`` (default: the optimizer's ``lr``);
  ``WarmupDecayLR`` decays linearly from ``warmup_max_lr`` (default 0.001) to 0 at
  ``total_num_steps``; ``WarmupCosineLR`` multiplies the optimizer's own ``lr`` by a ratio
  that warms up from ``warmup_min_ratio`` to 1 and then follows a half cosine down to
  ``cos_min_ratio`` at ``total_num_steps``, where it stays.

Where DeepSpeed only logs a warning, an unknown ``warmup_type`` here is a ValueError (no
silent fallback to ``"log"``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

WARMUP_TYPES = ("log", "linear")


class WarmupLR:
    """Warm up each group's learning rate from ``warmup_min_lr`` to ``warmup_max_lr`` over
    ``warmup_num_steps`` steps, then hold it."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        if warmup_max_lr is None:
            warmup_max_lr = optimizer.param_groups[0]["lr"]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self._init_warmup(warmup_num_steps, warmup_type, last_batch_iteration)

    def _init_warmup(self, warmup_num_steps: int, warmup_type: str, last_batch_iteration: int) -> None:
        if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
            raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
        if warmup_type not in WARMUP_TYPES:
            raise ValueError(f"warmup_type must be one of {', '.join(WARMUP_TYPES)}, got {warmup_type!r}")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = self._apply() if last_batch_iteration == -1 else None

    def _warmup_fraction(self) -> float:
        """0 -> 1 over the warm-up iterations (log or linear), 1 after."""
        i = self.last_batch_iteration
        if i >= self.warmup_num_steps:
            return 1.0
        if self.warmup_type == "log":
            return math.log(i + 1) / math.log(self.warmup_num_steps)
        return i / self.warmup_num_steps

    def _gamma(self) -> float:
        return self._warmup_fraction()

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]

    def _apply(self) -> list[float]:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        return lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = (self.last_batch_iteration + 1 if last_batch_iteration is None
                                     else last_batch_iteration)
        self._last_lr = self._apply()

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError("get_last_lr() before the first step()")
        return self._last_lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``, then a linear decay to 0 at ``total_num_steps``."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: float | Sequence[float] = 0.0, warmup_max_lr: float | Sequence[float] = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return self._warmup_fraction()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(WarmupLR):
    """The optimizer's own ``lr`` times a ratio: warm-up from ``warmup_min_ratio`` to 1,
    then a half cosine to ``cos_min_ratio`` at ``total_num_steps``, held after."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        self._init_warmup(warmup_num_steps, warmup_type, last_batch_iteration)

    def lr_ratio(self) -> float:
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            return self.warmup_min_ratio + self._warmup_fraction() * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (i - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


def _per_group(optimizer: torch.optim.Optimizer, value: float | Sequence[float], name: str) -> list[float]:
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{name} has {len(value)} values for {groups} optimizer parameter groups")
        return list(value)
    return [value] * groups


SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR)}
