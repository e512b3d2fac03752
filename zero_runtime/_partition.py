"""Flat parameter units: how parameters are grouped, flattened and partitioned.

A ``FlatUnit`` is the runtime's bucket: a group of parameters of one optimizer group laid out
by one ``FlatLayout``. A *partitioned* unit (stage 3, parameters above the persistence
threshold) frees its parameters between uses; any other unit keeps them whole on every
rank and re-assembles them after each optimizer step (stage 0's units are laid out with one
shard, the whole buffer, which every rank holds and updates: nothing to re-assemble). It owns

* ``full``   the flat parameter buffer in the compute dtype; while it is allocated every
  parameter's ``.data`` is a view of it. A partitioned unit frees it between uses;
* ``shard``  this rank's slice of the parameters in the compute dtype (a partitioned unit
  keeps it as its own tensor, any other unit as a view of ``full``);
* ``master`` this rank's fp32 slice, the ``nn.Parameter`` the torch optimizer updates
  (None in a *frozen* unit: stage 3 partitions frozen parameters too, see [Note: frozen
  units]);
* ``grad_shard`` this rank's reduced gradient, accumulated over micro-steps (empty in a
  frozen unit);
* ``full_grad`` the flat gradient buffer the reduce-scatter reads, made by ``comm._grad_reduce``
  (stage 1 keeps it, stages 2 and 3 allocate it for one backward).

[Note: freeing stage-3 parameters] Freeing does two things. It resizes the storage of
``full`` to zero bytes: autograd saves views of parameters (``weight.t()`` in linear) that
share that storage, so they hold no memory while freed and read the gathered values again
after the next gather refills the same storage (FSDP's technique). And it points every
parameter's ``.data`` at an empty tensor (DeepSpeed's technique), so code that reads a freed
parameter without going through the module (``model.parameters()``, ``state_dict()``) sees
an empty tensor instead of reading freed memory; gathering points ``.data`` back at views of
``full``.

[Note: frozen units] In stage 3, frozen parameters (``requires_grad=False``) above the
persistence threshold are partitioned by module like trainable ones, in units of their own
(``frozen=True``, ``group_index == -1``): gathered for forward and again for backward (the
input gradient of a frozen linear needs its weight), never reduced, with no fp32 master and
no optimizer state. They are not in ``TrainingState.units`` (what the optimizer, the
gradient reducer and checkpoints see) but in ``TrainingState.frozen_units`` (checkpoints
hold their shards for the offline export only). With no gradients to count, a frozen unit's
backward use ends when every module call whose outputs backward reached has the gradients
of all its inputs (``_param_hooks``; ``backward_holds`` counts those calls), or at the end
of backward when a call's inputs need no gradient.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from typing import Iterable, Sequence

import torch
from torch import nn

from ._flat_buffer import aligned_layout


class GatherState(enum.Enum):
    FREE = "free"
    GATHERING = "gathering"
    READY = "ready"


class FlatUnit:
    def __init__(self, *, index: int, group_index: int, names: Sequence[str], params: Sequence[nn.Parameter],
                 world_size: int, rank: int, dtype: torch.dtype, partition_params: bool, position: int,
                 frozen: bool = False, align: int = 1, slices: int | None = None) -> None:
        """``world_size`` / ``rank``: the shards of the layout and which one this rank holds
        (1 and 0 in stage 0). ``position``: where the unit's first parameter comes in the
        model's parameter order; its gradients are final about when that parameter's are (see
        ``comm._grad_reduce``). ``align``: the alignment wanted, granted when cheap
        (``aligned_layout``; see [Note: parameter-aligned blocks] in ``_flat_buffer``), with
        the total split into ``slices`` (``FlatLayout``)."""
        assert params and len(names) == len(params)
        assert not frozen or (partition_params and not any(p.requires_grad for p in params))
        self.frozen = frozen
        self.index = index
        self.group_index = group_index
        self.partitioned = partition_params
        self.position = position
        self.names = tuple(names)
        self.params = tuple(params)
        self.dtype = dtype
        self.layout = aligned_layout([p.shape for p in params], world_size=world_size, align=align, slices=slices)
        self.shard_rank = rank
        lo, hi = self.shard_range()
        with torch.no_grad():
            flat32 = self.layout.flatten([p.detach() for p in params], dtype=torch.float32)
            self.master = None if frozen else nn.Parameter(flat32[lo:hi].clone())
            self.full = flat32.to(dtype) if dtype != torch.float32 else flat32
            self.shard = self.full[lo:hi].clone() if partition_params else self.full[lo:hi]
        self._views = self.layout.views(self.full)
        self._empty = torch.empty(0, dtype=dtype, device=self.full.device)
        self._point_params_at_full()
        self.grad_shard = torch.zeros(0 if frozen else self.layout.shard_numel, dtype=dtype, device=self.full.device)
        self.full_grad: torch.Tensor | None = None
        self.grads_seen = 0
        self.grad_params = sum(p.requires_grad for p in params)
        # Stage-3 gather bookkeeping, driven by ``_stage3.ParamScheduler``.
        self.state = GatherState.READY
        self.handle = None
        self.refs = 0
        self.in_backward = False
        self.prefetched = False  # counted in the prefetch window (see [Note: the window holds kept units])
        self.gathered_version = -1  # the shard's version ``full`` was (is being) gathered from
        self.use_position: int | None = None
        self.pinned = 0  # open GatheredParameters blocks holding it (see [Note: pinned units])
        self.backward_holds = 0  # frozen units: calls whose backward still needs it
        if partition_params:
            self.free_full()

    def shard_range(self) -> tuple[int, int]:
        """Where this rank's shard (``shard``, ``master``, ``grad_shard``) lies in ``full``."""
        return self.layout.shard_range(self.shard_rank)

    @property
    def full_nbytes(self) -> int:
        return self.layout.numel * self.full.element_size()

    def alloc_full(self) -> None:
        """Give ``full`` its memory back (contents undefined until a gather fills it)."""
        self.full.untyped_storage().resize_(self.full_nbytes)
        self._point_params_at_full()

    def mark_gathered(self) -> None:
        """``full`` holds (or a gather in flight will hold) the shard as it is now."""
        self.gathered_version = self.shard._version

    def gathered_is_stale(self) -> bool:
        """Whether the shard was written in place since ``full`` was gathered from it."""
        return self.shard._version != self.gathered_version

    def free_full(self) -> None:
        for param in self.params:
            param.data = self._empty
        self.full.untyped_storage().resize_(0)
        self.state = GatherState.FREE

    def _point_params_at_full(self) -> None:
        for param, view in zip(self.params, self._views, strict=True):
            param.data = view


def trainable_named_parameters(model: nn.Module) -> "OrderedDict[nn.Parameter, str]":
    """Each trainable parameter once (tied ones under their first name), in model order."""
    found: OrderedDict[nn.Parameter, str] = OrderedDict()
    for name, param in model.named_parameters():
        if param.requires_grad:
            found.setdefault(param, name)
    return found


def group_by_size(params: Sequence[nn.Parameter], bucket_numel: int) -> list[list[nn.Parameter]]:
    """Consecutive buckets of about ``bucket_numel`` elements, filled in reverse model order:
    gradients become ready roughly in that order, so a bucket fills during backward."""
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for param in reversed(params):
        if buckets[-1] and size + param.numel() > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += param.numel()
    return buckets


def group_by_module(model: nn.Module, params: Iterable[nn.Parameter], *,
                    fuse_numel: int = 0) -> list[list[nn.Parameter]]:
    """The units stage 3 gathers, in module order (the first module to register a tied
    parameter owns it): ``params`` are the partitioned parameters, others are not counted.

    Walking the modules top-down, a module whose whole subtree holds at most ``fuse_numel``
    of ``params``' elements not yet owned becomes one unit with all of them (its
    descendants are not visited); any other module gets one unit with its directly
    registered ones. ``fuse_numel == 0`` gives one unit per module.

    [Note: fused units] Every gather is one collective whose latency does not shrink with its
    size, so one unit per small module (norms, biases) pays that latency dozens of times per
    step; fusing a transformer block into one unit makes the same traffic a few large
    collectives, as FSDP2 does.
    """
    wanted = set(params)
    owned: set[nn.Parameter] = set()
    buckets: list[list[nn.Parameter]] = []

    def take(candidates: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        mine = [p for p in dict.fromkeys(candidates) if p in wanted and p not in owned]
        owned.update(mine)
        return mine

    def visit(module: nn.Module) -> None:
        subtree = [p for p in module.parameters() if p in wanted and p not in owned]
        if subtree and sum(p.numel() for p in subtree) <= fuse_numel:
            buckets.append(take(subtree))
            return
        mine = take(module.parameters(recurse=False))
        if mine:
            buckets.append(mine)
        for child in module.children():
            visit(child)

    visit(model)
    return buckets


def optimizer_indices(optimizer: torch.optim.Optimizer, units: list[FlatUnit]) -> list[int]:
    """Per unit, the index of its master in ``optimizer.state_dict()``'s numbering (the order of
    the parameters over the param groups)."""
    order = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return [order[id(u.master)] for u in units]
