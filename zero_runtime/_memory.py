"""``memory_report()``: the model-state bytes this rank holds, by category.

Counts persistent tensors only (what the ZeRO paper's formulas describe): the compute-dtype
parameters this rank keeps (full buffers in stages 1-2 and for stage 3's persistent units,
its shard of stage 3's partitioned units, frozen ones included; frozen parameters the
runtime does not partition and buffers are not counted: they are the model's, not the
training state's), its gradient buffers (full in stage 1, its
reduced shard in stages 2-3) and its optimizer states (fp32 master shard plus every tensor
in the torch optimizer's state), and the parameter copies the communication objects keep
between uses (hpZ's secondary partition) or between steps (LoCo's error buffers, created
by each bucket's first reduction). With ``offload_optimizer`` the fp32 masters and Adam
states live off the training device (host memory, or the swap file with ``nvme``): they are
``offloaded_optimizer_states``, not part of ``total`` (the bytes on the training device), and
``optimizer_states`` is then 0. With ``offload_param`` the partitioned units' shards live off
the device between uses (host memory on a GPU run, the swap file with ``nvme``): they are
``offloaded_parameters`` and not in ``parameters`` (``cpu`` on a CPU run moves nothing and
reports 0 offloaded). Transient buffers are not counted: stage-3 units
gathered for their use or kept gathered until their next one (at most
``stage3_max_live_parameters`` elements beyond the units in use), and gradient buckets in
flight (at most ``MAX_IN_FLIGHT`` buckets of at most ``reduce_bucket_size`` elements each, or
one larger unit each; see [Note: gradient buffer lifetimes] in ``comm._grad_reduce``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._state import TrainingState


class MemoryReport(NamedTuple):
    """Bytes of model state held by this rank, by category (every field is in bytes).
    ``print(report)`` shows each in MiB with its byte count; ``total`` is the training
    device's share (the offloaded fields are not in it)."""

    parameters: int
    gradients: int
    optimizer_states: int
    secondary_parameters: int = 0  # copies kept by the gather objects (hpZ), 0 without ZeRO++
    error_feedback: int = 0  # LoCo's INT8 error buffers kept by qgZ (zeropp_loco_param), else 0
    offloaded_optimizer_states: int = 0  # masters and Adam states in host memory or on NVMe; not in total
    offloaded_parameters: int = 0  # stage 3's shards in host memory or on NVMe (offload_param); not in total

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.secondary_parameters + \
            self.error_feedback

    def __str__(self) -> str:
        fields = [*self._fields[:5], "total", *self._fields[5:]]
        width = max(map(len, fields))
        lines = [f"  {name:<{width}} {getattr(self, name) / 2**20:12.3f} MiB  ({getattr(self, name):,} bytes)"
                 for name in fields]
        return "\n".join(["MemoryReport (model-state bytes on this rank; offloaded_* are not in total):", *lines])


def measure(state: TrainingState, *, secondary_bytes: int, error_feedback_bytes: int = 0) -> MemoryReport:
    """The persistent model-state bytes of ``state``, plus ``secondary_bytes`` the gather
    objects hold (``CommPlan.held_bytes``) and ``error_feedback_bytes`` the reduce-scatter
    holds (LoCo's buffers, ``ReduceScatter.held_bytes``)."""
    units = state.units
    shards = sum(_nbytes(u.shard) for u in units + state.frozen_units if u.partitioned)
    params = sum(u.full_nbytes for u in units if not u.partitioned)
    moved = state.param_offload is not None and state.param_offload.moves_shards
    params += 0 if moved else shards
    offloaded_params = state.param_offload.held_bytes() if moved else 0
    # Stage 1 reduces from full gradient buffers it keeps, stage 0 keeps them and whole reduced
    # gradients (see [Note: stage 0] in ``comm._all_reduce``); stages 2 and 3 keep only shards.
    grads = sum((_nbytes(u.full_grad) if state.stage in (0, 1) else 0) + (_nbytes(u.grad_shard) if state.stage != 1 else 0)
                for u in units)
    if state.offload is not None:
        states, offloaded = 0, state.offload.held_bytes()
    else:
        states, offloaded = sum(_nbytes(u.master) for u in units), 0
        for optimizer_state in state.optimizer.state.values():
            states += sum(_nbytes(v) for v in optimizer_state.values() if isinstance(v, torch.Tensor))
    return MemoryReport(parameters=params, gradients=grads, optimizer_states=states,
                        secondary_parameters=secondary_bytes, error_feedback=error_feedback_bytes,
                        offloaded_optimizer_states=offloaded, offloaded_parameters=offloaded_params)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
