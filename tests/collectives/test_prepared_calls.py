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
    """A prepared call skips finding its plan (the collective's look-up by the call's sizes and
    options): on the caller's thread it enters fewer Python frames than the cached collective."""
    inputs, flat = _bucket(0)
    outputs = list(flat.split(SIZES))
    prepared = prepare_reduce_scatter_q4_coalesced(outputs, inputs, op=dist.ReduceOp.AVG)
    direct = _count(lambda: zcomm.reduce_scatter_q4_coalesced(outputs, inputs, op=dist.ReduceOp.AVG))
    held = _count(lambda: prepared(outputs, inputs))
    assert held < direct, (held, direct)
    x, full = torch.randn(1000), torch.empty(1000)
    gather = prepare_all_gather_q8(full, x)
    assert _count(lambda: gather(full, x)) < _count(lambda: zcomm.all_gather_q8(full, x))


def test_plans_hold_their_worker_and_stats_row(gloo_world) -> None:
    """A plan resolves its CPU worker and its stats row once ([Note: held workers], [Note: held
    stats rows]): the worker is the group's FIFO executor of the kind, and reset_comm_stats()
    zeroes the held rows in place, so calls after a reset are counted from zero."""
    from zcomm import _chain_runner
    from zcomm.topology import Topology

    x, out = torch.randn(1024), torch.empty(1024)
    gather = prepare_all_gather_q8(out, x)
    inputs, flat = _bucket(0)
    reduce = prepare_reduce_scatter_q4_coalesced(list(flat.split(SIZES)), inputs)
    one = Topology(world_size=1, local_size=1)
    assert gather._plan.worker is _chain_runner._ordered_worker(dist.group.WORLD, one, "gather")
    assert reduce._plan.worker is _chain_runner._ordered_worker(dist.group.WORLD, one, "reduce")
    zcomm.reset_comm_stats()
    gather(out, x)
    zcomm.all_gather_q8(out, x)
    reduce(list(flat.split(SIZES)), inputs)
    assert zcomm.comm_stats()["all_gather_q8"].calls == 2 and zcomm.comm_stats()["reduce_scatter_q4"].calls == 1
    zcomm.reset_comm_stats()
    assert "all_gather_q8" not in zcomm.comm_stats() and "reduce_scatter_q4" not in zcomm.comm_stats()
    gather(out, x)
    reduce(list(flat.split(SIZES)), inputs)
    zcomm.reduce_scatter_q4_coalesced(list(flat.split(SIZES)), inputs)
    stats = zcomm.comm_stats()
    assert stats["all_gather_q8"] == zcomm.OpStats(1, 0, 0) and stats["reduce_scatter_q4"].calls == 2, stats
