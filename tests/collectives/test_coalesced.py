"""reduce_scatter_q4's layout and averaging: the coalesced form, the padded sizes, AVG.

On 4 gloo ranks (2 nodes x 2, 4 x 1 and 1 x 4), each checked byte for byte against an
oracle built from the flat collective:

* ``reduce_scatter_q4_coalesced(outputs, inputs)`` equals the flat ``reduce_scatter_q4`` of
  the inputs interleaved rank by rank (``torch.cat`` of their ``(W, -1)`` views), split
  into the outputs, with the same ``comm_stats``; for outputs that are the pieces of one
  buffer (written in place) and for separate outputs; empty tensors, sizes that need a zero
  fill, every dtype, group sizes 6, 30, the default and ``"tensor"``, 1-4 and default
  stages, SUM and AVG, sync and async;
* a slice size that ``pipeline_stages`` does not divide gives the bytes the zero-padded
  staging buffer of the earlier implementation gave (the flat collective of an input whose
  slices are padded by hand), and the kernel reads the caller's tensors where they are: the
  quantizing op is handed the very inputs (by address), never a copy;
* AVG is the fp32 SUM divided by ``W`` in fp32 and rounded once: bf16 AVG equals, bit for
  bit, the fp32 collective's SUM of the same values divided in fp32 and rounded to bf16.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

import zcomm
from collective_checks import DTYPES, OPS, make_inputs
from spawn_harness import run_distributed

# per-rank shard sizes of the tensors of a bucket
BUCKETS = ((5,), (3, 0, 17, 1), (1031, 6, 97), (2048, 512, 4099, 13))
GROUP_SIZES = (None, 6, 30, "tensor")


def _interleaved(inputs: list[torch.Tensor], world: int) -> torch.Tensor:
    """The flat form's input: slice r holds every input's slice r, in list order."""
    return torch.cat([x.view(world, -1) for x in inputs], dim=1).view(-1)


def _bucket(seed: int, sizes: tuple[int, ...], world: int, rank: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [make_inputs(seed + i, world, world * m, dtype)[rank].clone() for i, m in enumerate(sizes)]


def _check_coalesced(rank: int, world: int, topology: zcomm.Topology, index: int, case: dict) -> None:
    sizes, dtype, op = case["sizes"], case["dtype"], case["op"]
    kwargs = dict(group_size=case["group_size"], pipeline_stages=case["stages"], topology=topology)
    inputs = _bucket(100 * index, sizes, world, rank, dtype)
    zcomm.reset_comm_stats()
    flat_out = torch.empty(sum(sizes), dtype=dtype)
    zcomm.reduce_scatter_q4(flat_out, _interleaved(inputs, world), op, **kwargs)
    flat_stats = zcomm.comm_stats()["reduce_scatter_q4"]
    expected = list(flat_out.split(sizes))
    if case["in_place"]:
        buffer = torch.full((sum(sizes),), float("nan"), dtype=dtype)
        outputs = list(buffer.split(sizes))
    else:
        outputs = [torch.full((m,), float("nan"), dtype=dtype) for m in sizes]
    zcomm.reset_comm_stats()
    handle = zcomm.reduce_scatter_q4_coalesced(outputs, inputs, op, async_op=case["async_op"], **kwargs)
    if case["async_op"]:
        handle.wait()
    for i, (got, want) in enumerate(zip(outputs, expected, strict=True)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (topology, case, i)
    assert zcomm.comm_stats()["reduce_scatter_q4"] == flat_stats, case


def _coalesced_cases(seed: int):
    rng = random.Random(seed)
    for index, sizes in enumerate(BUCKETS * 2):
        yield dict(
            sizes=sizes,
            dtype=DTYPES[index % len(DTYPES)],
            op=OPS[index % len(OPS)],
            group_size=rng.choice(GROUP_SIZES),
            stages=rng.choice((None, 1, 2, 3, 4)),
            in_place=index % 2 == 0,
            async_op=index % 4 >= 2,
        )


class _ReorderSpy:
    """Records what the ``cpu`` backend's quantizer (behind its ``reorder_quantize`` kernel, which
    the collective calls directly) is handed: the tensors' addresses and the fill."""

    def __init__(self) -> None:
        from zcomm.quant.backends import cpu

        self.module = cpu
        self.original = cpu._quantize_into
        self.calls: list[tuple[list[int], int, int]] = []

    def __enter__(self) -> _ReorderSpy:
        def spy(xs, parts, part_numel, *args):
            self.calls.append(([t.data_ptr() for t in xs], parts, part_numel))
            return self.original(xs, parts, part_numel, *args)

        self.module._quantize_into = spy
        return self

    def __exit__(self, *exc: object) -> None:
        self.module._quantize_into = self.original


def _check_padding_reads_in_place(rank: int, world: int, topology: zcomm.Topology) -> None:
    """Slices that the stages do not divide: the old staging buffer's bytes, with no staging copy."""
    for index, (m, stages, group_size) in enumerate(((1001, 4, None), (13, 3, 6), (5, 4, "tensor"), (2, 4, 30))):
        dtype = DTYPES[index % len(DTYPES)]
        part = -(-m // stages)
        full = make_inputs(500 + index, world, world * m, dtype)[rank].clone()
        staged = torch.zeros(world, stages * part, dtype=dtype)  # what the earlier implementation copied into
        staged[:, :m] = full.view(world, m)
        padded_out = torch.empty(stages * part, dtype=dtype)
        kwargs = dict(group_size=group_size, pipeline_stages=stages, topology=topology)
        zcomm.reduce_scatter_q4(padded_out, staged.view(-1), **kwargs)
        out = torch.empty(m, dtype=dtype)
        with _ReorderSpy() as spy:
            zcomm.reduce_scatter_q4(out, full, **kwargs)
        assert torch.equal(out.view(torch.uint8), padded_out[:m].view(torch.uint8)), (topology, m, stages)
        assert spy.calls == [([full.data_ptr()], world, stages * part)], spy.calls
    inputs = _bucket(600, (7, 0, 12), world, rank, torch.bfloat16)
    with _ReorderSpy() as spy:
        zcomm.reduce_scatter_q4_coalesced([torch.empty(7), torch.empty(0), torch.empty(12)], [x.float() for x in inputs],
                                          pipeline_stages=2, topology=topology)  # fmt: skip
        outputs = [torch.empty(m, dtype=torch.bfloat16) for m in (7, 0, 12)]
        zcomm.reduce_scatter_q4_coalesced(outputs, inputs, pipeline_stages=2, topology=topology)
    assert spy.calls[1] == ([x.data_ptr() for x in inputs], world, 20), spy.calls


def _check_avg_is_one_fp32_division(rank: int, world: int, topology: zcomm.Topology) -> None:
    """bf16 AVG == (fp32 SUM of the same values) / W in fp32, rounded to bf16 once."""
    for stages in (1, 3):
        inputs = _bucket(700 + stages, (300, 41), world, rank, torch.bfloat16)
        averaged = [torch.empty(m, dtype=torch.bfloat16) for m in (300, 41)]
        summed = [torch.empty(m) for m in (300, 41)]
        zcomm.reduce_scatter_q4_coalesced(averaged, inputs, dist.ReduceOp.AVG, pipeline_stages=stages,
                                          topology=topology)  # fmt: skip
        zcomm.reduce_scatter_q4_coalesced(summed, [x.float() for x in inputs], dist.ReduceOp.SUM,
                                          pipeline_stages=stages, topology=topology)  # fmt: skip
        for got, total in zip(averaged, summed, strict=True):
            expected = (total / torch.tensor(float(world))).to(torch.bfloat16)
            assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), stages


def _main(rank: int, world: int) -> int:
    checked = 0
    for local in (2, 1, 4):
        topology = zcomm.Topology(world_size=world, local_size=local)
        for index, case in enumerate(_coalesced_cases(seed=local)):
            _check_coalesced(rank, world, topology, index, case)
            checked += 1
        _check_padding_reads_in_place(rank, world, topology)
        _check_avg_is_one_fp32_division(rank, world, topology)
    dist.barrier()
    return checked


@pytest.mark.slow
def test_coalesced_padded_and_averaged_reduce_scatter_q4_match_the_flat_form():
    assert run_distributed(_main, 4, timeout=400) == [3 * 2 * len(BUCKETS)] * 4
