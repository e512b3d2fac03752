"""Prepared collectives ([Note: prepared calls] in zcomm.reduce_scatter_q4): the same bytes as the
collective they prepare, the contract's checks on every call, and a thinner host path."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

import zcomm
from zcomm.all_gather_q8 import prepare_all_gather_q8
from zcomm.reduce_scatter_q4 import prepare_reduce_scatter_q4_coalesced

SIZES = [100, 200, 300, 424]



def _bucket(seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen).to(torch.bfloat16) for n in SIZES], torch.empty(sum(SIZES),
                                                                                            dtype=torch.bfloat16)


@pytest.mark.parametrize("stages", (1, 3))
def test_prepared_reduce_scatter_equals_the_collective(gloo_world, stages: int) -> None:
    inputs, flat = _bucket(0)
    prepared = prepare_reduce_scatter_q4_coalesced(list(flat.split(SIZES)), inputs, op=dist.ReduceOp.AVG,
                                                   group_size=64, pipeline_stages=stages)
    for seed in range(3):  # new buffers of the same shapes every call
        inputs, flat = _bucket(seed)
        expected = torch.empty_like(flat)
        zcomm.reduce_scatter_q4_coalesced(list(expected.split(SIZES)), inputs, op=dist.ReduceOp.AVG, group_size=64,
                                          pipeline_stages=stages)
        prepared(flat.split(SIZES), inputs, async_op=True).wait()
        assert torch.equal(flat, expected), seed


def test_prepared_reduce_scatter_with_error_feedback(gloo_world) -> None:
    inputs, flat = _bucket(0)
    outputs = list(flat.split(SIZES))
    prepared = prepare_reduce_scatter_q4_coalesced(outputs, inputs, group_size=64, with_error_feedback=True)
    mine, theirs = zcomm.ErrorFeedback(), zcomm.ErrorFeedback()
    expected = torch.empty_like(flat)
    for _ in range(3):
        prepared(outputs, inputs, error_feedback=mine)
        zcomm.reduce_scatter_q4_coalesced(list(expected.split(SIZES)), inputs, group_size=64, error_feedback=theirs)
        assert torch.equal(flat, expected)
    with pytest.raises(ValueError, match="with error feedback"):
        prepared(outputs, inputs)


def test_prepared_calls_check_the_tensors(gloo_world) -> None:
    inputs, flat = _bucket(0)
    prepared = prepare_reduce_scatter_q4_coalesced(list(flat.split(SIZES)), inputs)
    with pytest.raises(ValueError, match="other sizes"):
        prepared(list(flat.split(SIZES)), [x.float() for x in inputs])
    with pytest.raises(ValueError, match="other sizes"):
        prepared(list(flat.split(SIZES))[:3], inputs[:3])
    with pytest.raises(ValueError):  # what the collective raises: sizes that do not pair up
        prepare_reduce_scatter_q4_coalesced([flat[:10]], [inputs[0]])
    x, full = torch.randn(1000), torch.empty(1000)
    gather = prepare_all_gather_q8(full, x, group_size=64)
    with pytest.raises(ValueError, match="other sizes"):
        gather(full[:500], x[:500])
    with pytest.raises(ValueError, match="other sizes"):
        gather(torch.empty(2000)[::2], x)


def test_prepared_all_gather_equals_the_collective(gloo_world) -> None:
    x, full, expected = torch.randn(1000), torch.empty(1000), torch.empty(1000)
    gather = prepare_all_gather_q8(full, x, group_size=64)
    gather(full, x, async_op=True).wait()
    zcomm.all_gather_q8(expected, x, group_size=64)
    assert torch.equal(full, expected)


def _count(call) -> int:  # noqa: ANN001
    call()
    entered = []
    sys.setprofile(lambda frame, event, arg: entered.append(1) if event == "call" else None)
    try:
        call()
    finally:
        sys.setprofile(None)
    return len(entered)


def test_prepared_calls_enter_fewer_frames(gloo_world) -> None:
    """A prepared call skips the prologue cache, the plan's key and the option checks: on the
    caller's thread it enters fewer Python frames than the cached collective."""
    inputs, flat = _bucket(0)
    outputs = list(flat.split(SIZES))
    prepared = prepare_reduce_scatter_q4_coalesced(outputs, inputs, op=dist.ReduceOp.AVG)
    direct = _count(lambda: zcomm.reduce_scatter_q4_coalesced(outputs, inputs, op=dist.ReduceOp.AVG))
    held = _count(lambda: prepared(outputs, inputs))
    assert held <= direct - 8, (held, direct)
    x, full = torch.randn(1000), torch.empty(1000)
    gather = prepare_all_gather_q8(full, x)
    assert _count(lambda: gather(full, x)) <= _count(lambda: zcomm.all_gather_q8(full, x)) - 5
