"""``TrainingState``: what a run has learned, apart from how it computes and communicates.

Checkpointing (``checkpoint._sharded``) saves and restores it and memory reporting (``_memory``)
measures it; neither sees ``ZeroOptimizer``, its hooks or its schedulers. ``ZeroOptimizer``
owns one and updates its counters; the comm plan, the gradient reducer and the stage-3
scheduler act on the same units but are not part of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ._loss_scaler import LossScaler
from ._partition import FlatUnit

if TYPE_CHECKING:
    from .offload._optimizer import OptimizerOffload
    from .offload._params import ParamOffload


@dataclass(eq=False, kw_only=True)
class TrainingState:
    """This rank's partition of the training state.

    ``stage`` says which parts are partitioned (see ``ZeroConfig``); ``units`` hold the
    parameters, their fp32 master shards and the reduced gradient shards; ``frozen_units``
    hold stage 3's partitioned frozen parameters (no master, no gradient); ``optimizer`` is
    the torch optimizer over the masters; ``scaler`` the loss scale; ``lr_scheduler`` the
    config's learning-rate schedule, if any; ``global_step`` counts applied optimizer steps
    and ``skipped_steps`` those skipped on an fp16 overflow.
    """

    stage: int
    units: list[FlatUnit]
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    frozen_units: list[FlatUnit] = field(default_factory=list)  # stage 3's frozen parameters, partitioned
    lr_scheduler: Any = None  # a ``lr_schedules`` schedule over ``optimizer``, from the config
    global_step: int = 0
    skipped_steps: int = 0
    # offload_optimizer: the masters and the optimizer state live there, not in ``units``'
    # masters (emptied) and ``optimizer.state`` (unused); see ``offload._optimizer``.
    offload: "OptimizerOffload | None" = None
    # offload_param (stage 3): the partitioned units' shards live there between uses; read
    # them inside ``offload._params.resident`` (see [Note: shard residency]).
    param_offload: "ParamOffload | None" = None
