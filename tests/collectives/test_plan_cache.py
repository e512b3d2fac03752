"""The collectives' plan cache: one plan per (group, sizes, options), gone with its group.

* ``cached_plan`` makes a plan once per key and group, keeps typed options apart (``8`` and
  ``8.0``), does not cache unhashable keys, drops the oldest plan beyond ``MAX_PLANS`` and
  forgets a group once it is dropped;
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
    monkeypatch.setattr(_plan_cache, "MAX_PLANS", 2)
    group = _Group()
    plans = [cached_plan(group, (i,), object) for i in range(3)]
    assert cached_plan(group, (2,), object) is plans[2]
    assert cached_plan(group, (0,), object) is not plans[0]  # dropped when (2,) came in
    size = len(_plan_cache._PLANS)
    del group
    gc.collect()
    assert len(_plan_cache._PLANS) == size - 1



def test_collectives_resolve_their_plan_once(gloo_world, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {"gather": 0, "reduce": 0}

    def counting(kind, make):
        def run(*args):
            counts[kind] += 1
            return make(*args)

        return run

    monkeypatch.setattr(qwz, "_make_plan", counting("gather", qwz._make_plan))
    monkeypatch.setattr(qgz, "_make_shape", counting("reduce", qgz._make_shape))
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
