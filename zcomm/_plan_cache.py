"""Prepared plans of the quantized collectives, cached per process group and call shape.

A collective's plan (its quantization spec resolved to an int group size, its private
subgroups, its pipeline chunks, the bytes it sends) depends only on the group, its topology,
the sizes and element width of the tensors and the call's options, never on the data. A
training step calls the same collective on the same shapes over and over, so each
collective resolves its plan once per such key and looks it up afterwards: the host work per
call is the tensor checks of the prologue, a dictionary lookup and the chain itself.

[Note: plan cache lifetime] Plans are kept per caller's ``ProcessGroup`` object, weakly, as
zcomm's subgroups are ([Note: cache lifetime] in :mod:`zcomm._groups`): once a group is
destroyed and dropped, its plans go with it, and a group made later is a new key even where
torch reuses its name. Each group keeps at most :data:`MAX_PLANS` plans (the oldest is
dropped first), so a caller that sweeps through many shapes cannot grow the cache without
bound. Keys hold the types of option values next to the values, so ``8.0`` or ``True`` never
find the plan made for ``8`` or ``1``: an invalid option always reaches its check.
"""

from __future__ import annotations

import weakref
from typing import Callable, Hashable, TypeVar

import torch.distributed as dist

MAX_PLANS = 256

Plan = TypeVar("Plan")

_PLANS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[Hashable, object]] = weakref.WeakKeyDictionary()


def cached_plan(group: dist.ProcessGroup, key: tuple, make: Callable[[], Plan]) -> Plan:
    """The plan of ``key`` on ``group``: ``make()`` the first time, the same object afterwards.

    ``key`` must determine the plan completely. A key that cannot be hashed (an option of a
    wrong type, such as a list) is not cached: ``make()`` runs, and its checks raise.
    """
    plans = _PLANS.get(group)
    if plans is None:
        plans = _PLANS.setdefault(group, {})
    try:
        plan = plans.get(key)
    except TypeError:
        return make()
    if plan is None:
        plan = make()
        if len(plans) >= MAX_PLANS:
            del plans[next(iter(plans))]
        plans[key] = plan
    return plan  # type: ignore[return-value]


def typed(value: object) -> tuple[type, object]:
    """``value`` with its type, for a key in which ``8`` and ``8.0`` (or ``1`` and ``True``) differ."""
    return type(value), value
