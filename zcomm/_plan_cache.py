"""The cache of the quantized collectives' plans, per process group and call shape, and the one
bounded cache zcomm keeps such things in.

A collective's plan (:mod:`zcomm._plan`: its checked tensors and options, its private
subgroups, its pipeline chunks, the bytes it sends, its planned kernels) depends only on the
group, its topology, the sizes, dtypes and devices of the tensors and the call's options,
never on the data. A training step calls the same collective on the same shapes over and
over, so each collective makes its plan once per such key and looks it up afterwards: the
host work per call is a dictionary lookup and the chain itself ([Note: one plan per call]).
This is the one cache keyed on a call's sizes.

* :class:`BoundedCache` (defined in :mod:`zcomm.quant._bounded_cache`, the layer below, whose
  spec cache and the cuda backend's op launch plans use it too): a dict of at most ``limit``
  entries, the oldest dropped first, whose :meth:`~BoundedCache.get_or_make` makes a missing
  value on demand (one per FSDP2 comm holds its prepared calls: [Note: a comm's prepared
  calls] in :mod:`zcomm.fsdp`);
* :class:`GroupCache`: one :class:`BoundedCache` per live process group, held weakly in the
  group: the plans (:data:`_PLANS`, through :func:`zcomm._plan.find_plan` and
  :func:`zcomm._plan.keep_plan`).

[Note: plan cache lifetime] Plans are kept per caller's ``ProcessGroup`` object, and only
as long as that object lives: once a group is destroyed and the caller drops it, its plans
go with it, and a group made later is a new key even where torch reuses its name. A
``weakref.WeakKeyDictionary`` alone does not give that: its values are held strongly, so a
value that refers to its key keeps the key alive for good. So nothing a
:class:`GroupCache` holds refers to its group. A plan holds what the group resolved to (its
rank, size and topology in a :class:`~zcomm._contract.GroupInfo`, which has no group; its
private subgroups; its CPU worker; its stats row), never the group; the collectives pass
the group they were called with to the lookup and to the plan's maker, which uses it and
lets it go. That costs nothing per call (the caller's argument is at hand), where a plan
holding a ``weakref`` to its group would resolve it on every call. What the plans hold
goes with them: the workers' threads exit once no plan holds their executor
([Note: held workers] in :mod:`zcomm._chain_runner`), and the private subgroups are
destroyed with their parent ([Note: cache lifetime] in :mod:`zcomm._groups`). A prepared
call (:func:`zcomm.prepare_all_gather_q8`, :func:`zcomm.prepare_reduce_scatter_q4_coalesced`)
is the caller's and holds its group and plan: while the caller keeps it, the group, its
subgroups and workers stay; no cache here holds a prepared call.

Each group keeps at most :data:`MAX_PLANS` plans (the oldest is dropped first), so a caller
that sweeps through many shapes cannot grow the cache without bound. Keys hold the types of
option values next to the values, so ``8.0`` or ``True`` never find the plan made for ``8``
or ``1``: an invalid option always reaches its check. A key that cannot be hashed (an
option of a wrong type, such as a list) or a group that cannot be weakly referenced (not a
``ProcessGroup``) is not cached: the maker runs and its checks raise, exactly as they would
on a first call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from functools import partial
from typing import Any, TypeVar

import torch.distributed as dist

from .quant._bounded_cache import BoundedCache

MAX_PLANS = 256

Value = TypeVar("Value")

# serializes the creation of a group's cache (misses only; a hit takes no lock)
_LOCK = threading.Lock()


class GroupCache:
    """One :class:`BoundedCache` of ``limit`` entries per live process group, keyed weakly.

    A group's cache is dropped when the group object is collected ([Note: plan cache
    lifetime]), so a value must never refer to its group. A group's entry is keyed by its
    plain weak reference, the one ``weakref.ref(group)`` returns while any exists: kept alive
    as the key, it makes a lookup one C call that allocates nothing and two dict lookups that
    match by identity, with no Python frame and no lock. A second reference, with a callback,
    drops the entry when the group goes.
    """

    __slots__ = ("limit", "_caches", "_watches")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._caches: dict[weakref.ref, BoundedCache] = {}
        self._watches: dict[weakref.ref, weakref.ref] = {}  # the same keys -> the reference that drops them

    def __len__(self) -> int:
        """How many groups have a cache."""
        return len(self._caches)

    def __getitem__(self, group: dist.ProcessGroup) -> BoundedCache:
        """``group``'s cache (``KeyError`` if it has none)."""
        return self._caches[weakref.ref(group)]

    def lookup(self, group: dist.ProcessGroup, key: Hashable) -> Any:
        """The value of ``key`` on ``group``; None if there is none (or the lookup cannot be cached)."""
        try:
            cache = self._caches.get(weakref.ref(group))
            return None if cache is None else cache.get(key)
        except TypeError:  # unhashable key, or a group that cannot be weakly referenced
            return None

    def get_or_make(self, group: dist.ProcessGroup, key: Hashable, make: Callable[[], Value]) -> Value:
        """:meth:`BoundedCache.get_or_make` in ``group``'s cache (made on first use).

        ``make()`` runs before :meth:`remember`'s guard, so a ``TypeError`` it raises propagates
        unchanged; an uncacheable key or group only makes :meth:`remember` keep nothing.
        """
        value = self.lookup(group, key)
        return value if value is not None else self.remember(group, key, make())

    def remember(self, group: dist.ProcessGroup, key: Hashable, value: Value) -> Value:
        """Keep ``value`` for ``key`` in ``group``'s cache and return it; not kept where ``key``
        cannot be hashed or ``group`` cannot be weakly referenced."""
        try:
            ref = weakref.ref(group)
            cache = self._caches.get(ref)
            if cache is None:
                with _LOCK:
                    cache = self._caches.get(ref)
                    if cache is None:
                        self._watches[ref] = weakref.ref(group, partial(self._drop, ref))
                        cache = self._caches[ref] = BoundedCache(self.limit)
            return cache.remember(key, value)
        except TypeError:
            return value

    def _drop(self, ref: weakref.ref, _: weakref.ref) -> None:
        """The callback of a group's second reference: its group is gone."""
        self._caches.pop(ref, None)
        self._watches.pop(ref, None)


_PLANS = GroupCache(MAX_PLANS)


def cached_plan(group: dist.ProcessGroup, key: tuple, make: Callable[[], Value]) -> Value:
    """The plan of ``key`` on ``group``: ``make()`` the first time, the same object afterwards.

    ``key`` must determine the plan completely, and the plan must not refer to ``group``
    ([Note: plan cache lifetime]).
    """
    return _PLANS.get_or_make(group, key, make)


def typed(value: object) -> tuple[type, object]:
    """``value`` with its type, for a key in which ``8`` and ``8.0`` (or ``1`` and ``True``) differ."""
    return type(value), value
