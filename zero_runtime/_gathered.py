"""``GatheredParameters``: parameters full on every rank for a block, edits written back.

Entering gathers, with an exact (never quantized) all-gather of the compute-dtype shards,
every partitioned unit that owns one of the given parameters, and pins it: the stage-3
scheduler neither frees nor re-gathers a pinned unit, so forwards, ``state_dict()`` and
Hugging Face's ``save_pretrained`` inside the block see the full weights. Parameters kept
whole anyway (stages 1-2, persistent units, parameters the runtime does not manage) need no
gather. Entering and leaving are collective: every rank of the run enters with the same
parameters.

With ``modifier_rank=r``, leaving broadcasts rank r's values of every unit the block
gathered (and of given parameters outside any unit) to all ranks and writes them
everywhere they live: the compute-dtype shard (or full buffer) and the fp32 master shard
the optimizer updates, so the next ``step()`` starts from the edited weights (DeepSpeed
leaves its fp32 masters stale here). Derived copies are invalidated through
``CommPlan.weights_changed`` (hpZ secondaries). Edits on other ranks are discarded;
without ``modifier_rank`` every edit is discarded (the shards are not touched). Under bf16
or fp16 an edited value reaches the fp32 master rounded to the compute dtype, which is the
precision the block exposes. The optimizer's moments are not changed.

[Note: pinned units] A pinned unit stays READY whatever the scheduler decides: ``_end_use``
and ``free_all`` skip it. One the block found FREE is gathered here, outside the
scheduler's accounting (``live`` does not count it), and freed on exit unless an enclosing
block still pins it; one the scheduler already held gathered (kept after a forward, or read
outside any forward) is gathered again exactly, in place, and left to the scheduler. ``step()`` refuses to run
while a unit is pinned, as it would rewrite shards under a full buffer the block exposes.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable

import torch
from torch import nn

from ._partition import FlatUnit, GatherState
from ._partitioned_init import is_partitioned

_OWNER = "_zero_owner"  # attribute on each managed parameter: weakref to its ZeroOptimizer
# (typed Any here: ``optimizer`` imports this module, so this one cannot import it back)


def register_owner(opt: Any) -> None:
    """Let ``GatheredParameters`` find ``opt`` from any of its units' parameters."""
    ref = weakref.ref(opt)
    for unit in opt.units + opt.frozen_units:
        for param in unit.params:
            setattr(param, _OWNER, ref)


def owner_of(param: nn.Parameter) -> Any:
    ref = getattr(param, _OWNER, None)
    return ref() if ref is not None else None


class GatheredParameters:
    """Context manager: ``params`` (a parameter, an iterable of them, or a module for all of
    its parameters) are full on every rank inside the block; see the module docstring."""

    def __init__(self, params: nn.Parameter | Iterable[nn.Parameter] | nn.Module,
                 modifier_rank: int | None = None) -> None:
        if isinstance(params, nn.Module):
            params = list(params.parameters())
        elif isinstance(params, torch.Tensor):
            params = [params]
        else:
            params = list(dict.fromkeys(params))
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError("GatheredParameters takes a parameter, an iterable of parameters or an nn.Module")
        if any(is_partitioned(p) for p in params):
            raise RuntimeError("GatheredParameters got parameters built under zero_runtime.Init and not yet handed "
                               "to zero_runtime.initialize(); call initialize() first, or change them inside a "
                               "zero_runtime.Init() block (in-place calls there see the full values)")
        owners = {id(o): o for o in (owner_of(p) for p in params) if o is not None}
        if len(owners) > 1:
            raise ValueError("the parameters belong to several zero_runtime runs; gather each run's separately")
        self.opt = next(iter(owners.values()), None)
        if modifier_rank is not None and self.opt is not None and not 0 <= modifier_rank < self.opt.plan.world_size:
            raise ValueError(f"modifier_rank must be a rank of the run's group (0..{self.opt.plan.world_size - 1}), "
                             f"got {modifier_rank}")
        self.modifier_rank = modifier_rank
        self.units: list[FlatUnit] = []
        self.loose: list[torch.Tensor] = []
        if self.opt is not None:
            unit_of = {p: u for u in self.opt.units + self.opt.frozen_units for p in u.params}
            self.units = list(dict.fromkeys(unit_of[p] for p in params if p in unit_of))
            self.loose = [p for p in params if p not in unit_of]
        self._gathered: list[FlatUnit] = []

    def __enter__(self) -> None:
        if self.opt is None:
            return
        self.opt.require_idle("entering GatheredParameters")
        for unit in self.units:
            if unit.partitioned and unit.pinned == 0:
                self._gather(unit)
            unit.pinned += 1

    def _gather(self, unit: FlatUnit) -> None:
        """Exact values in ``unit.full``: a unit the scheduler holds gathered is gathered
        again in place (a qwZ forward gather is only approximate) and stays the scheduler's."""
        if unit.state is GatherState.GATHERING:
            self.opt.scheduler.wait(unit)
        if unit.state is GatherState.FREE:
            if self.opt.param_offload is not None:  # the scheduler's units are resident already
                self.opt.param_offload.fetch(unit)
            unit.alloc_full()
            self._gathered.append(unit)
        self.opt.plan.exact_all_gather(unit.full, unit.shard)
        unit.mark_gathered()
        unit.state = GatherState.READY

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.opt is None:
            return
        try:
            if self.modifier_rank is not None and exc_type is None:
                self._write_back()
        finally:
            self.opt.plan.weights_replaced()  # a whole unit may have been edited in place on one rank
            for unit in self.units:
                unit.pinned -= 1
            for unit in self._gathered:
                if unit.pinned == 0:
                    unit.free_full()
                    if self.opt.param_offload is not None:  # written home if the block changed it
                        self.opt.param_offload.evict(unit)

    def _write_back(self) -> None:
        """Rank ``modifier_rank``'s values everywhere: full buffers, shards, masters."""
        plan = self.opt.plan
        with torch.no_grad():
            for unit in self.units:
                plan.broadcast(unit.full, self.modifier_rank)
                lo, hi = unit.shard_range()
                if unit.partitioned:
                    unit.shard.copy_(unit.full[lo:hi])
                    unit.mark_gathered()
                if unit.master is None:  # frozen units have none
                    continue
                if self.opt.offload is not None:  # the masters live off the device (nvme: in the swap file)
                    self.opt.offload.set_master(unit.index, unit.full[lo:hi])
                else:
                    unit.master.copy_(unit.full[lo:hi])
            for tensor in self.loose:
                plan.broadcast(tensor.data, self.modifier_rank)
        plan.weights_changed()


class StateDictGuard:
    """The switch of ``guard_state_dict``'s hooks (off while ``full_state_dict`` reads the
    keys, where the freed values are replaced by the gathered masters)."""

    def __init__(self) -> None:
        self.enabled = True

    @contextlib.contextmanager
    def suspended(self):
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True


def guard_state_dict(model: nn.Module, units: list[FlatUnit]) -> StateDictGuard:
    """Make ``state_dict()`` of any module holding a freed stage-3 parameter raise.

    [Note: state_dict under stage 3] A freed parameter's ``.data`` is empty (see [Note:
    freeing stage-3 parameters] in ``_partition``), so a plain ``state_dict()`` would return
    zero-size tensors that ``save_pretrained`` writes and ``from_pretrained`` rejects. Gathering
    inside ``state_dict()`` would make it a collective, which deadlocks the common
    ``if rank == 0: torch.save(model.state_dict(), ...)``. So it raises, naming the two
    ways that work: ``GatheredParameters(model)`` around it on every rank (compute dtype,
    every rank) or ``opt.full_state_dict()`` (fp32 masters, rank 0). The check is a
    ``state_dict`` pre-hook on every module that registers a partitioned parameter, so it
    also covers ``submodule.state_dict()``.
    """
    unit_of = {p: u for u in units for p in u.params}
    guard = StateDictGuard()

    def check(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not guard.enabled:
            return
        freed = [f"{prefix}{name}" for name, p in module.named_parameters(recurse=False)
                 if p in unit_of and unit_of[p].state is not GatherState.READY]
        if freed:
            raise RuntimeError(
                f"state_dict() under ZeRO stage 3: {', '.join(freed)} are partitioned and not gathered here. "
                "Call it inside `with zero_runtime.GatheredParameters(model):` on every rank (full weights in "
                "the compute dtype, e.g. for save_pretrained), or use opt.full_state_dict() (fp32 masters, rank 0)")

    for module in model.modules():
        if any(p in unit_of for p in module.parameters(recurse=False)):
            module.register_state_dict_pre_hook(check)
    return guard
