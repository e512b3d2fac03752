"""The quantization ops' spec cache (``zcomm.quant.ops._SPECS``): hits are the same objects, and
the cache stays bounded however many group sizes a caller sweeps."""

from __future__ import annotations

import pytest
import torch

import zcomm.quant as q
from zcomm.quant import ops
from zcomm.quant._bounded_cache import BoundedCache


@pytest.fixture()
def small(monkeypatch: pytest.MonkeyPatch) -> BoundedCache:
    cache = BoundedCache(4)
    monkeypatch.setattr(ops, "_SPECS", cache)
    return cache


def test_a_hit_returns_the_same_spec_objects(small) -> None:
    first = ops._spec(8, 256)
    assert ops._spec(8, 256) is first and first[0].group_size == first[1] == 256
    tensor = ops._spec(4, "tensor")
    assert ops._spec(4, "tensor") is tensor and tensor[1] is None
    default = ops._spec(8, None)
    assert ops._spec(8, None) is default and len(small) == 3


def test_the_public_op_reuses_the_cached_spec(small) -> None:
    x = torch.randn(1024)
    q.quantize(x, 8, 128)
    entry = ops._spec(8, 128)
    q.quantize(x, 8, 128)
    assert ops._spec(8, 128) is entry and len(small) == 1


def test_a_sweep_of_group_sizes_keeps_the_newest_entries(small) -> None:
    entries = {g: ops._spec(8, g) for g in range(2, 12)}
    assert len(small) == 4
    for g in range(8, 12):  # the newest four are hits
        assert ops._spec(8, g) is entries[g]
    again = ops._spec(8, 2)  # evicted: validated and made again, equal to the first
    assert again is not entries[2] and again == entries[2] and len(small) == 4


def test_the_default_bound_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ops, "_SPECS", BoundedCache(ops._MAX_SPECS))
    for g in range(2, 2 + 3 * ops._MAX_SPECS, 2):  # even: INT4 groups
        ops._spec(4, g)
    assert len(ops._SPECS) == ops._MAX_SPECS


def test_invalid_specs_raise_and_are_not_kept(small) -> None:
    for bits, group_size in ((8.0, 64), (True, 64), (8, 1), (8, [64])):
        with pytest.raises((TypeError, ValueError)):
            ops._spec(bits, group_size)
    assert len(small) == 0
