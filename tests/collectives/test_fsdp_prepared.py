"""zcomm.fsdp's comms hold prepared calls ([Note: a comm's prepared calls]): one per group, sizes,
dtype, device and (reduce-scatter) op value, made on the first call of such a key; later calls
run neither the prologue nor a plan lookup, and give the bytes of the collective they prepare."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

import zcomm
import zcomm.fsdp
from frame_count import entered_functions
from zcomm import _fsdp_blocks

NUMEL = 1024


def _frames(call: Callable[[], object]) -> list[str]:
    """The Python functions one ``call()`` enters on this thread."""
    return entered_functions(call)


def _resolves_nothing(again: list[str], first: list[str]) -> bool:
    """Whether a call that repeats a prepared one (``again``) enters at most a third of the frames
    of the call that prepared it (``first``: prologue, plan): nothing is resolved again, whatever
    the functions that resolve it are called."""
    return len(again) <= len(first) / 3


def _comms(group: dist.ProcessGroup, one_rank: zcomm.Topology, layout=None):
    topologies = zcomm.fsdp._GroupTopologies(group, one_rank)
    common = dict(group_size=64, module_name="unit", layout=layout)
    return (zcomm.fsdp.ZeroppAllGather(topologies, quantized=True, **common),
            zcomm.fsdp.ZeroppReduceScatter(topologies, quantized=True, first_hop_bits=8, hadamard_block=16,
                                           **common))  # fmt: skip


def test_second_call_runs_no_prologue(gloo_world, one_rank) -> None:
    """The first call of each comm prepares (prologue, plan); the second, with new buffers of the
    same sizes and, for the reduce-scatter, a PREMUL_SUM op built anew with the same factor, runs
    neither, and enters fewer frames."""
    gather, reduce = _comms(gloo_world, one_rank)
    x = torch.randn(NUMEL)
    calls = {
        "gather": lambda: gather(torch.empty(NUMEL), x.clone(), gloo_world),
        "reduce": lambda: reduce(torch.empty(NUMEL), x.clone(), gloo_world, dist._make_nccl_premul_sum(0.5)),
    }
    for name, call in calls.items():
        first, second = _frames(call), _frames(call)
        assert _resolves_nothing(second, first), (name, len(second), len(first), second)
    assert len(gather._prepared) == 1 and len(reduce._prepared) == 1


def test_prepared_calls_give_the_collectives_bytes(gloo_world, one_rank) -> None:
    """Each comm's result equals the drop-in collective's with the comm's options, call after call."""
    gather, reduce = _comms(gloo_world, one_rank)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(NUMEL, generator=gen)
        got, expected = torch.empty(NUMEL), torch.empty(NUMEL)
        gather(got, x, gloo_world)
        zcomm.all_gather_q8(expected, x, gloo_world, group_size=64, topology=one_rank)
        assert torch.equal(got, expected)
        for op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM, dist._make_nccl_premul_sum(0.25)):
            work = reduce(got, x, gloo_world, op, async_op=True)
            work.wait()
            zcomm.reduce_scatter_q4(expected, x, op, gloo_world, group_size=64, topology=one_rank, first_hop_bits=8,
                                    hadamard_block=16)
            assert torch.equal(got, expected), op
    # one prepared call per op value: AVG, SUM and PREMUL_SUM(0.25), however often its object is rebuilt
    assert len(reduce._prepared) == 3


def test_op_is_keyed_by_value(gloo_world, one_rank) -> None:
    """PREMUL_SUM is keyed by its factor: another factor is another prepared call, with its own
    divisor; an op the collective rejects still raises its ValueError and is never cached."""
    _, reduce = _comms(gloo_world, one_rank)
    x = torch.randn(NUMEL)
    results = {}
    for factor in (0.5, 0.25, 0.5):
        out = torch.empty(NUMEL)
        reduce(out, x, gloo_world, dist._make_nccl_premul_sum(factor))
        results.setdefault(factor, []).append(out)
    assert len(reduce._prepared) == 2
    assert torch.equal(results[0.5][0], results[0.5][1])
    assert torch.equal(results[0.25][0] * 2, results[0.5][0])  # exact: a power-of-two factor
    for bad in (dist.ReduceOp.MAX, dist._make_nccl_premul_sum(-1.0)):
        try:
            reduce(torch.empty(NUMEL), x, gloo_world, bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{bad} was accepted")
    assert len(reduce._prepared) == 2


def test_prepared_calls_are_bounded_per_comm(gloo_world, one_rank) -> None:
    """A comm that sees many sizes keeps at most _MAX_PREPARED prepared calls, the newest."""
    gather, _ = _comms(gloo_world, one_rank)
    sizes = range(64, 64 * (zcomm.fsdp._MAX_PREPARED + 4), 64)
    for numel in sizes:
        gather(torch.empty(numel), torch.randn(numel), gloo_world)
    assert len(gather._prepared) == zcomm.fsdp._MAX_PREPARED
    assert [key[2] for key in gather._prepared] == list(sizes)[-zcomm.fsdp._MAX_PREPARED :]


def test_aligned_staging_uses_one_prepared_call(gloo_world, one_rank) -> None:
    """The aligned path stages through fresh buffers every call: the same prepared call serves them,
    and the result is the collective's on the staged rows, unpadded."""
    layout = _fsdp_blocks.aligned_layout([1000, 3000], align=64)
    assert layout is not None
    gather, reduce = _comms(gloo_world, one_rank, layout)
    x = torch.randn(layout.numel)
    first = _frames(lambda: reduce(torch.empty(layout.numel), x, gloo_world, dist.ReduceOp.AVG))
    for _ in range(2):
        out = torch.empty(layout.numel)
        gather(out, x, gloo_world)
        staged = layout.pad(x, rows=1)
        expected = torch.empty(staged.numel())
        zcomm.all_gather_q8(expected, staged, gloo_world, group_size=64, topology=one_rank)
        unpadded = torch.empty(layout.numel)
        layout.unpad(expected, unpadded, rows=1)
        assert torch.equal(out, unpadded)
        reduce(torch.empty(layout.numel), x, gloo_world, dist.ReduceOp.AVG)
    assert len(gather._prepared) == 1 and len(reduce._prepared) == 1
    again = _frames(lambda: reduce(torch.empty(layout.numel), x, gloo_world, dist.ReduceOp.AVG))
    assert _resolves_nothing(again, first), (len(again), len(first), again)


def test_non_contiguous_tensors_get_the_collectives_error(gloo_world, one_rank) -> None:
    """Tensors a prepared call does not take reach the collective, which names what is wrong."""
    gather, _ = _comms(gloo_world, one_rank)
    x = torch.randn(NUMEL, 2)[:, 0]
    try:
        gather(torch.empty(NUMEL), x, gloo_world)
    except ValueError as exc:
        assert "contiguous" in str(exc), exc
    else:
        raise AssertionError("a non-contiguous input was accepted")
    assert not gather._prepared
