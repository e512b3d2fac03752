"""zcomm's collectives for one rank of worlds of 6 to 4096 ranks: groups, plans, bytes and values.

Every expected number is computed here from the topology and the wire format
(``conftest.payload_bytes``), not read from zcomm. Values: the fake backend delivers this
rank's own rows to every hop (pinned in ``tests/runtime/test_zero_torch_compat.py``), so qwZ's
output is W copies of this rank's dequantized input, and qgZ's AVG is the mean over the ``W``
slices of this rank's input, within the two INT4 roundings' bound: each hop moves an element
by at most half its group's scale, ``absmax / 14`` of what it quantizes (hop 1 per source,
hop 2 per node sum of at most ``L`` sources), so the mean is off by at most ``absmax / 7``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zcomm
from scale_cases import LAYOUTS, case_id, cases, fake_rank, op_bytes, payload_bytes, ring_bytes
from zcomm._groups import node_groups

CASES = cases()


def _topology(world: int, local: int) -> zcomm.Topology:
    return zcomm.Topology(world_size=world, local_size=local)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_hop_groups_hold_this_ranks_node_and_its_peers(case):
    world, local, rank = case
    nodes, node, local_rank = world // local, rank // local, rank % local
    with fake_rank(rank, world):
        for kind in ("gather", "reduce"):
            groups = node_groups(dist.group.WORLD, _topology(world, local), kind)
            if local == 1:
                assert groups.intra is None
            else:
                assert dist.get_process_group_ranks(groups.intra) == list(range(node * local, (node + 1) * local))
                assert dist.get_rank(groups.intra) == local_rank
            if nodes == 1:
                assert groups.inter is None
            else:
                assert dist.get_process_group_ranks(groups.inter) == list(range(local_rank, world, local))
                assert dist.get_rank(groups.inter) == node


def _qwz_expected(world: int, local: int, payload: int) -> tuple[int, int]:
    nodes = world // local
    return (local - 1) * nodes * payload, (nodes - 1) * payload


def _check_gathered(output: torch.Tensor, input: torch.Tensor, world: int) -> None:
    """Every row is this rank's input after one INT8 round trip (error <= absmax / 254 per group)."""
    rows = output.view(world, -1)
    assert torch.equal(rows, rows[:1].expand_as(rows))
    bound = input.abs().max() / 254 * 1.0001
    assert (rows[0] - input).abs().max() <= bound


@pytest.mark.parametrize("numel", [1, 37, 32])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_all_gather_q8_bytes_and_rows(case, numel):
    world, local, rank = case
    torch.manual_seed(rank)
    input = torch.randn(numel)
    output = torch.full((world * numel,), float("nan"))
    with fake_rank(rank, world):
        assert zcomm.all_gather_q8(output, input, topology=_topology(world, local)) is None
        assert op_bytes("all_gather_q8") == (1, *_qwz_expected(world, local, payload_bytes(numel, 8)))
    _check_gathered(output, input, world)


@pytest.mark.parametrize("case", cases(((384, 8), (2048, 8), (4096, 2), (2040, 8))), ids=case_id)
def test_all_gather_q8_pipelined_chunks_of_whole_groups(case):
    """1000 elements = 4 groups in 3 stages: chunks of 1, 1 and 2 groups (256, 256, 488 elements)."""
    world, local, rank = case
    input = torch.randn(1000)
    output = torch.empty(world * 1000)
    with fake_rank(rank, world):
        handle = zcomm.all_gather_q8(output, input, async_op=True, pipeline_stages=3, topology=_topology(world, local))
        handle.wait()
        payload = payload_bytes(256, 8) + payload_bytes(256, 8) + payload_bytes(488, 8)
        assert op_bytes("all_gather_q8") == (1, *_qwz_expected(world, local, payload))
    _check_gathered(output, input, world)


def _qgz_expected(world: int, local: int, stages: int, part: int, first_bits: int = 4) -> tuple[int, int]:
    nodes = world // local
    intra = stages * (local - 1) * payload_bytes(nodes * part, first_bits if local > 1 else 4)
    return intra, stages * (nodes - 1) * payload_bytes(part, 4)


def _check_mean(output: torch.Tensor, input: torch.Tensor, world: int) -> None:
    """AVG of W copies of this rank's rows: the mean of its W slices, within absmax / 7."""
    expected = input.view(world, -1).double().mean(0)
    bound = input.abs().max().double() / 7 * 1.001
    assert (output.double() - expected).abs().max() <= bound


@pytest.mark.parametrize("slice_numel, stages", [(1, None), (5, None), (5, 2)])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_reduce_scatter_q4_bytes_and_mean(case, slice_numel, stages):
    """Stages 2 of a 5-element slice: parts of 3, the last read as zero-filled (padding)."""
    world, local, rank = case
    torch.manual_seed(rank)
    input = torch.randn(world * slice_numel)
    output = torch.full((slice_numel,), float("nan"))
    with fake_rank(rank, world):
        zcomm.reduce_scatter_q4(output, input, op=dist.ReduceOp.AVG, pipeline_stages=stages,
                                topology=_topology(world, local))
        k = stages or 1
        part = -(-slice_numel // k)
        assert op_bytes("reduce_scatter_q4") == (1, *_qgz_expected(world, local, k, part))
    _check_mean(output, input, world)


@pytest.mark.parametrize("case", cases(((24, 8), (384, 8), (4096, 8), (2040, 8), (4096, 1))), ids=case_id)
def test_reduce_scatter_q4_int8_first_hop(case):
    world, local, rank = case
    input = torch.randn(world * 3)
    output = torch.empty(3)
    with fake_rank(rank, world):
        zcomm.reduce_scatter_q4(output, input, op=dist.ReduceOp.AVG, first_hop_bits=8,
                                topology=_topology(world, local))
        assert op_bytes("reduce_scatter_q4") == (1, *_qgz_expected(world, local, 1, 3, first_bits=8))
    _check_mean(output, input, world)


@pytest.mark.parametrize("case", cases(((12, 2), (384, 8), (2048, 8), (4096, 8), (2040, 8))), ids=case_id)
def test_coalesced_and_prepared_forms(case):
    """A bucket of slices 2 and 3 sends what one 5-element slice sends; prepared calls count per call."""
    world, local, rank = case
    topology = _topology(world, local)
    inputs = [torch.randn(world * 2), torch.randn(world * 3)]
    outputs = [torch.empty(2), torch.empty(3)]
    with fake_rank(rank, world):
        zcomm.reduce_scatter_q4_coalesced(outputs, inputs, op=dist.ReduceOp.AVG, topology=topology)
        one = _qgz_expected(world, local, 1, 5)
        assert op_bytes("reduce_scatter_q4") == (1, *one)
        for output, input in zip(outputs, inputs, strict=True):
            _check_mean(output, input, world)
        prepared = zcomm.prepare_reduce_scatter_q4_coalesced(outputs, inputs, op=dist.ReduceOp.AVG, topology=topology)
        for _ in range(2):
            outputs = [torch.full((2,), float("nan")), torch.full((3,), float("nan"))]
            prepared(outputs, inputs)
        assert op_bytes("reduce_scatter_q4") == (3, 3 * one[0], 3 * one[1])
        for output, input in zip(outputs, inputs, strict=True):
            _check_mean(output, input, world)
        shard = torch.randn(7)
        gather = zcomm.prepare_all_gather_q8(torch.empty(world * 7), shard, topology=topology)
        for _ in range(2):
            gathered = torch.empty(world * 7)
            gather(gathered, shard)
        assert op_bytes("all_gather_q8") == (2, *[2 * b for b in _qwz_expected(world, local, payload_bytes(7, 8))])
        _check_gathered(gathered, shard, world)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_plain_collectives_count_the_ring(case):
    world, local, rank = case
    with fake_rank(rank, world):
        zcomm.all_gather_into_tensor(torch.empty(world * 3, dtype=torch.bfloat16), torch.ones(3, dtype=torch.bfloat16),
                                     topology=_topology(world, local))
        zcomm.reduce_scatter_tensor(torch.empty(3), torch.ones(world * 3), topology=_topology(world, local))
        assert op_bytes("all_gather_into_tensor") == (1, *ring_bytes(6, rank, world, local))
        assert op_bytes("reduce_scatter_tensor") == (1, *ring_bytes(12, rank, world, local))


def test_layouts_cover_the_issue_sizes():
    assert {w for w, _ in LAYOUTS} >= {6, 12, 24, 384, 2048, 4096}
    assert {l for _, l in LAYOUTS} == {1, 2, 8}
    assert any((w // l) % 2 for w, l in LAYOUTS if w >= 2000)  # an odd node count at scale
