"""The collectives' plan cache: one plan per (group, sizes, options), gone with its group.

* ``cached_plan`` makes a plan once per key and group, keeps typed options apart (``8`` and
  ``8.0``), does not cache unhashable keys, drops the oldest plan beyond ``MAX_PLANS`` and
  forgets a group once it is dropped;
* the caches it is built on (``BoundedCache``, ``GroupCache``, shared with the prologue and
  zcomm.fsdp's comms) let whatever ``make()`` raises through unchanged, never mistaking it for
  the lookup's own ``TypeError`` of an unhashable key, and cache nothing for a "group" that
  cannot be weakly referenced; an unhashable ``topology`` gets the prologue's error, also
  once the group's call shapes are cached;
* ``all_gather_q8`` and ``reduce_scatter_q4`` on a world of one gloo rank resolve their plan
  on the first call only, and a changed option or size makes a new one.
"""

from __future__ import annotations

import gc
import importlib

import pytest
import torch

import zcomm
from zcomm import _plan_cache
from zcomm._plan_cache import cached_plan, typed

# the modules (zcomm's attributes of these names are the functions)
qwz = importlib.import_module("zcomm.all_gather_q8")
qgz = importlib.import_module("zcomm.reduce_scatter_q4")


class _Group:
    """Stands in for a ProcessGroup: any object that can be weakly referenced."""


def test_made_once_per_key_and_typed() -> None:
    group, made = _Group(), []

    def make(value):
        return lambda: made.append(value) or object()

    first = cached_plan(group, ("op", typed(8)), make(8))
    assert cached_plan(group, ("op", typed(8)), make(8)) is first
    assert cached_plan(group, ("op", typed(8.0)), make(8.0)) is not first
    assert cached_plan(_Group(), ("op", typed(8)), make(8)) is not first
    assert made == [8, 8.0, 8]


def test_unhashable_key_is_not_cached() -> None:
    group, made = _Group(), []
    for _ in range(2):
        cached_plan(group, ("op", typed([1])), lambda: made.append(1))
    assert made == [1, 1]


def test_oldest_plan_dropped_and_group_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_plan_cache._PLANS, "limit", 2)  # for the caches of groups made from now on
    group = _Group()
    plans = [cached_plan(group, (i,), object) for i in range(3)]
    assert cached_plan(group, (2,), object) is plans[2]
    assert cached_plan(group, (0,), object) is not plans[0]  # dropped when (2,) came in
    size = len(_plan_cache._PLANS)
    del group
    gc.collect()
    assert len(_plan_cache._PLANS) == size - 1


def test_bounded_cache_makes_once_and_drops_the_oldest() -> None:
    cache, made = _plan_cache.BoundedCache(2), []
    first = cache.get_or_make("a", lambda: made.append("a") or object())
    assert cache.get_or_make("a", lambda: made.append("a") or object()) is first
    cache.get_or_make("b", object)
    cache.get_or_make("c", object)
    assert list(cache) == ["b", "c"] and made == ["a"]


class _ArgumentError(TypeError):
    """What a caller's bad argument raises from ``make()``: a TypeError, like a lookup's."""


def _raise() -> object:
    raise _ArgumentError("bad argument")


@pytest.mark.parametrize("key", [("op", 1), ("op", [1])], ids=["hashable", "unhashable"])
def test_make_errors_propagate_unchanged(key) -> None:
    for lookup in (lambda: _plan_cache.BoundedCache(4).get_or_make(key, _raise),
                   lambda: _plan_cache.GroupCache(4).get_or_make(_Group(), key, _raise),
                   lambda: cached_plan(_Group(), key, _raise)):
        with pytest.raises(_ArgumentError, match="bad argument") as raised:
            lookup()
        assert raised.value.__context__ is None  # not raised while handling the lookup's TypeError


def test_groups_without_weak_references_are_not_cached() -> None:
    cache, made = _plan_cache.GroupCache(4), []
    for _ in range(2):
        cache.get_or_make(7, ("op",), lambda: made.append(1) or object())
    assert made == [1, 1] and len(cache) == 0 and cache.lookup(7, ("op",)) is None


def test_unhashable_topology_gets_the_prologue_error(gloo_world) -> None:
    x, full = torch.randn(100), torch.empty(100)
    zcomm.all_gather_q8(full, x)  # the world's call shapes are cached from here on
    for _ in range(2):
        with pytest.raises(TypeError, match="topology must be a zcomm.Topology or None, got list"):
            zcomm.all_gather_q8(full, x, topology=[1, 1])
        with pytest.raises(TypeError, match="topology must be a zcomm.Topology or None, got list"):
            zcomm.reduce_scatter_q4_coalesced([full[:50]], [x[:50]], topology=[1, 1])



def test_collectives_resolve_their_plan_once(gloo_world, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {"gather": 0, "reduce": 0}

    def counting(kind, make):
        def run(*args):
            counts[kind] += 1
            return make(*args)

        return run

    monkeypatch.setattr(qwz, "_make_plan", counting("gather", qwz._make_plan))
    monkeypatch.setattr(qgz, "_make_plan", counting("reduce", qgz._make_plan))
    x = torch.randn(1000)
    full, out = torch.empty(1000), torch.empty(1000)
    for _ in range(3):
        zcomm.all_gather_q8(full, x, group_size=64)
        zcomm.reduce_scatter_q4(out, x, group_size=64, pipeline_stages=2)
    assert counts == {"gather": 1, "reduce": 1}
    zcomm.all_gather_q8(full, x, group_size=32)
    zcomm.reduce_scatter_q4(out, x, group_size=64, pipeline_stages=4)
    assert counts == {"gather": 2, "reduce": 2}
    expected = zcomm.quant.dequantize(zcomm.quant.quantize(x, 8, 32), 1000, 8, 32, torch.float32)
    assert torch.equal(full, expected)
