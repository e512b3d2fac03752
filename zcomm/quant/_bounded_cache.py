"""A dict of at most ``limit`` entries, the oldest dropped first: zcomm's one bounded cache.

It holds the collectives' plans per group and call shape (:mod:`zcomm._plan_cache`), an
FSDP2 comm's prepared calls (:mod:`zcomm.fsdp`) and the quantization ops' validated specs
(:mod:`zcomm.quant.ops`). It lives in ``zcomm.quant``, the lowest layer that uses it, so that
every layer above can share it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

Value = TypeVar("Value")

# what a lookup found when its key could not be looked up (unhashable)
_UNCACHED: Any = object()
# serializes insertions and evictions (misses only; a hit takes no lock)
_LOCK = threading.Lock()


class BoundedCache(dict):
    """A dict of at most ``limit`` entries: inserting beyond that drops the oldest one first.

    Values are never None (None means missing). Lookups are the dict's own; only an insertion
    (:meth:`remember`) takes a lock, so that two threads adding at once cannot both evict.
    """

    __slots__ = ("limit",)

    def __init__(self, limit: int) -> None:
        super().__init__()
        assert limit >= 1, limit
        self.limit = limit

    def get_or_make(self, key: Hashable, make: Callable[[], Value]) -> Value:
        """The value of ``key``: ``make()`` the first time, the same object afterwards.

        An unhashable ``key`` is not cached: ``make()`` runs every time. Whatever ``make()``
        raises propagates unchanged (the lookup's own ``TypeError`` is never mixed with it).
        """
        try:
            value = self.get(key)
        except TypeError:  # unhashable: not cached
            value = _UNCACHED
        if value is None:
            return self.remember(key, make())
        if value is _UNCACHED:
            return make()
        return value

    def remember(self, key: Hashable, value: Value) -> Value:
        """Keep ``value`` for ``key`` (dropping the oldest entry if full) and return it."""
        with _LOCK:
            if key not in self and len(self) >= self.limit:  # TypeError here for an unhashable key
                del self[next(iter(self))]
            assert value is not None, "None means missing"
            self[key] = value
        return value
