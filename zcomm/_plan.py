"""A collective's plan: one object that holds everything a call of a quantized collective needs.

[Note: one plan per call] A training step calls a collective with the same group, sizes,
dtypes, devices and options over and over, and nothing the call does before its chain
depends on the data. So each quantized collective resolves a :class:`Plan` once per such
call shape and finds it again on later calls: the group's rank, size and topology checked
with the tensors (:func:`zcomm._prologue.prologue`, which a call runs only when it makes a
plan), the options checked, the hops' private subgroups, the chunks or stages, the bytes it
sends, its stats row and worker, and its kernels *planned* for every call the chain makes
(:class:`Kernels`, [Note: planned kernels] in :mod:`zcomm.quant._contract`): on CUDA that
compiles, loads and sizes each kernel, uploads its device tables and runs its host checks,
so nothing is compiled or resolved between hops, and a failure there raises on every rank
before any hop is issued. The plans live in one :class:`~zcomm._plan_cache.GroupCache`
(keyed by the group and the call shape, [Note: plan cache lifetime]); a prepared call
(:func:`zcomm.prepare_all_gather_q8`, :func:`zcomm.prepare_reduce_scatter_q4_coalesced`)
holds its plan itself.

The call shape is the key: the collective's name, the ``topology`` argument, each tensor's
element count, dtype and device, and each option with its type (``8.0`` or ``True`` never
find the plan made for ``8`` or ``1``, so an invalid option always reaches its check). A call
finds its plan with one dictionary lookup when its tensors are plain contiguous
``torch.Tensor`` objects; anything else (a tensor subclass, a non-contiguous tensor) runs the
full checks, which raise for the exact reason or make a plan that is not kept.

:class:`GatherPlan` (qwZ, :mod:`zcomm.all_gather_q8`) and :class:`ReducePlan` (qgZ,
:mod:`zcomm.reduce_scatter_q4`) are the two collectives' plans; what they share is here.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from ._contract import GroupInfo
from ._plan_cache import _PLANS
from .quant import _capture, _contract, _registry


class Kernels(NamedTuple):
    """A plan's kernels, planned for the calls its chain makes ([Note: planned kernels]); None for
    an op the plan never calls."""

    quantize: Callable[..., None] | None
    dequantize: Callable[..., None] | None
    reorder_quantize: Callable[..., None] | None
    dequant_reduce: Callable[..., None] | None
    dequant_reduce_requant: Callable[..., None] | None


def plan_kernels(device: torch.device, uses: Mapping[str, Sequence[tuple]]) -> Kernels:
    """The backend's kernels (``$ZCOMM_BACKEND``, then ``device``'s) planned for ``uses``: op -> the
    uses of its calls. A plan keeps its backend."""
    planned = _contract.plan_kernels(_registry.select(None, device), device, uses)
    return Kernels(*(planned.get(op) for op in Kernels._fields))


class Plan:
    """What every collective's plan holds ([Note: one plan per call]); never the group itself
    ([Note: plan cache lifetime] in :mod:`zcomm._plan_cache`)."""

    __slots__ = ("info", "topology", "kernels", "bytes_sent", "stats", "worker")

    info: GroupInfo  # what the group resolved to
    kernels: Kernels
    bytes_sent: tuple[int, int]  # (intra, inter) per call, for comm_stats
    # resolved once, used per call: [Note: held stats rows], [Note: held workers]
    stats: Any
    worker: Any

    def __init__(self, **fields: Any) -> None:
        for name, value in fields.items():
            setattr(self, name, value)
        self.topology = self.info.topology


# find_plan(group, key): the plan kept for ``key`` on ``group``, None if there is none (a key of None
# or one that cannot be hashed finds none); the cache's own method, so a lookup enters one frame
find_plan: Callable[[dist.ProcessGroup, Hashable | None], Any] = _PLANS.lookup


def keep_plan(group: dist.ProcessGroup, key: Hashable | None, plan: Plan) -> Plan:
    """Keep ``plan`` for ``key`` on ``group`` (not when ``key`` is None) and return it."""
    return plan if key is None else _PLANS.remember(group, key, plan)


def check_plannable(device: torch.device, collective: str) -> None:
    """Making a plan under CUDA-graph capture is not capturable (subgroups, topology detection, table
    uploads): :class:`~zcomm.quant._capture.CaptureError` naming the fix ([Note: capture])."""
    if device.type == "cuda" and _capture.capturing():
        raise _capture.CaptureError(
            f"{collective} was called under CUDA-graph capture with a group, sizes, dtypes or options it has no plan for: "
            "making a plan creates subgroups, detects the topology and compiles and uploads kernels, which a capture "
            "cannot replay. Call it once outside the capture with the same arguments (a warm-up), then capture")
