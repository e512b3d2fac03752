"""all_reduce_q4 on gloo process groups, against fp64 sums within the oracle's bound.

The 4-rank spawn runs every (dtype, op, async) combination on topologies 1x4, 2x2 (found
from ZCOMM_LOCAL_SIZE in some cases) and 4x1 and on a 1x2 subgroup, with sizes that are not
multiples of the world size, tiny and empty tensors, 1-3 pipeline stages, INT4 and INT8 first
hops, INT8 and unquantized gathers; each case checks the per-element bound of
``collective_oracles.all_reduce_bound``, that every rank holds the same bits, and the
comm_stats rows. The prepared form, error feedback and Hadamard smoothing are checked on 2x2;
the argument checks on one rank.
"""

from __future__ import annotations

import random
from itertools import product

import pytest
import torch
import torch.distributed as dist

import zcomm
from collective_checks import DTYPES, OPS, _assert_within, _oracle_group_size, make_inputs
from collective_oracles import all_reduce_bound, all_reduce_volume, qgz_volume, ring_volume
from spawn_harness import run_distributed

SIZES = (0, 1, 3, 13, 97, 1031, 4099, 4 * 257)  # numel of the whole tensor: most are not multiples of W
GROUP_SIZES = (None, 6, 8, 30, "tensor")


def _cases(seed: int):
    rng = random.Random(seed)
    sizes = list(SIZES)
    rng.shuffle(sizes)
    for index, (dtype, op, async_op) in enumerate(product(DTYPES, OPS, (False, True))):
        yield dict(dtype=dtype, op=op, async_op=async_op, numel=sizes[index % len(sizes)], stages=1 + index % 3,
                   group_size=rng.choice(GROUP_SIZES), gather_group_size=rng.choice((None, 8, 30, "tensor")),
                   gather_bits=(8, 4, 8, None)[index % 4], first_hop_bits=8 if index % 3 == 2 else 4,
                   detect=index % 2 == 0, seed=seed * 100 + index)


def _same_on_every_rank(tensor: torch.Tensor, group: dist.ProcessGroup) -> bool:
    world = dist.get_world_size(group)
    wide = tensor.float()  # exact for bf16/fp16
    everyone = [torch.empty_like(wide) for _ in range(world)]
    dist.all_gather(everyone, wide, group=group)
    return all(torch.equal(other, wide) for other in everyone)


def _check_case(case: dict, group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtype, numel, stages = case["dtype"], case["numel"], case["stages"]
    given = None if case["detect"] and topology.local_size == 2 and world == 4 else topology
    inputs = make_inputs(case["seed"], world, numel, dtype)
    tensor = inputs[rank].clone().view(-1, 1) if numel else inputs[rank].clone()  # any shape
    zcomm.reset_comm_stats()
    handle = zcomm.all_reduce_q4(
        tensor, case["op"], group, case["async_op"], group_size=case["group_size"], gather_bits=case["gather_bits"],
        gather_group_size=case["gather_group_size"] if case["gather_bits"] else None, pipeline_stages=stages,
        topology=given, first_hop_bits=case["first_hop_bits"])
    if case["async_op"]:
        assert not handle.is_completed()  # the gather runs in wait() on CPU ([Note: all-reduce async])
        handle.wait()
        assert handle.is_completed()
    else:
        assert handle is None
    divide_by = world if case["op"] == dist.ReduceOp.AVG else 1
    exact = inputs.double().sum(0) / divide_by
    slice_numel = -(-numel // world)
    part = -(-slice_numel // stages)
    rs_gs = _oracle_group_size(case["group_size"], "reduce_scatter_q4", longest_row=topology.num_nodes * part)
    ag_gs = _oracle_group_size(case["gather_group_size"], "all_gather_q8" if case["gather_bits"] == 8
                               else "reduce_scatter_q4", longest_row=slice_numel)
    first_bits = case["first_hop_bits"] if topology.local_size > 1 else 4
    bound = all_reduce_bound(inputs.double(), nodes=topology.num_nodes, local=topology.local_size, stages=stages,
                             group_size=rs_gs, gather_group_size=ag_gs if case["gather_bits"] else None, dtype=dtype,
                             divide_by=divide_by, exact=exact, first_bits=first_bits,
                             gather_bits=case["gather_bits"] or 8)
    _assert_within("all_reduce_q4", case, tensor.view(-1).double() - exact, bound)
    assert _same_on_every_rank(tensor, group), case
    stats = zcomm.comm_stats()
    expected = all_reduce_volume(numel, topology.num_nodes, topology.local_size, stages, rs_gs, ag_gs,
                                 first_bits=first_bits, gather_bits=case["gather_bits"] or 8)
    if case["gather_bits"] is None:
        expected = {"reduce_scatter_q4": expected["reduce_scatter_q4"],
                    "all_gather_into_tensor": ring_volume(slice_numel * tensor.element_size(), rank, world,
                                                          topology.local_size)}
    assert {name: (row.calls, row.intra_bytes, row.inter_bytes) for name, row in stats.items()} == {
        name: (1, *volume) for name, volume in expected.items()}, case


def _check_prepared(group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
    """The prepared form gives the collective's bits, with and without error feedback, and rejects other shapes."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    options = dict(group_size=32, pipeline_stages=2, topology=topology)
    for gather_bits, numel in ((8, 1001), (4, 1003), (None, 1000)):
        prepared = zcomm.prepare_all_reduce_q4(torch.empty(numel, dtype=torch.bfloat16), dist.ReduceOp.AVG, group,
                                               gather_bits=gather_bits, **options)
        for seed in range(2):
            inputs = make_inputs(300 + seed, world, numel, torch.bfloat16)
            mine, theirs = inputs[rank].clone(), inputs[rank].clone()
            prepared(mine, async_op=seed == 1).wait() if seed == 1 else prepared(mine)
            zcomm.all_reduce_q4(theirs, dist.ReduceOp.AVG, group, gather_bits=gather_bits, **options)
            assert torch.equal(mine, theirs), (gather_bits, seed)
        with pytest.raises(ValueError, match="prepared all_reduce_q4 got a tensor of another numel"):
            prepared(torch.empty(numel + 1, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="prepared without error feedback"):
            prepared(torch.empty(numel, dtype=torch.bfloat16), error_feedback=zcomm.ErrorFeedback())
    with_feedback = zcomm.prepare_all_reduce_q4(torch.empty(999), group=group, with_error_feedback=True, **options)
    states = zcomm.ErrorFeedback(), zcomm.ErrorFeedback()
    inputs = make_inputs(310, world, 999, torch.float32)
    for _ in range(3):
        mine, theirs = inputs[rank].clone(), inputs[rank].clone()
        with_feedback(mine, error_feedback=states[0])
        zcomm.all_reduce_q4(theirs, group=group, error_feedback=states[1], **options)
        assert torch.equal(mine, theirs)


def _check_error_feedback_converges(group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
    """Reducing the same tensor T times with error feedback: the mean result is closer to the exact
    mean than one call is (LoCo's telescoping; the INT8 gather's rounding is what remains)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    inputs = make_inputs(320, world, 4096, torch.float32)
    exact = inputs.double().mean(0)
    one = inputs[rank].clone()
    zcomm.all_reduce_q4(one, group=group, topology=topology, group_size=64)
    feedback, total, calls = zcomm.ErrorFeedback(err_beta=0.0), torch.zeros(4096, dtype=torch.float64), 16
    for _ in range(calls):
        tensor = inputs[rank].clone()
        zcomm.all_reduce_q4(tensor, group=group, topology=topology, group_size=64, error_feedback=feedback)
        total += tensor.double()
    single = float((one.double() - exact).norm())
    averaged = float((total / calls - exact).norm())
    assert averaged < 0.5 * single, (averaged, single)


def _check_hadamard(group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
    """Hadamard smoothing of the reduce-scatter: same bits everywhere, and on heavy-tailed inputs a
    smaller error than without at the same bytes (one rank: 0.43x measured). With a spike in every
    group the INT8 gather's error, which the rotation does not touch, is about as large as the
    reduce-scatter's, and the rotation gains little."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    inputs = make_inputs(330, world, 4096, torch.float32)
    exact = inputs.double().mean(0)
    errors = {}
    for block in (None, 64):
        tensor = inputs[rank].clone()
        zcomm.reset_comm_stats()
        zcomm.all_reduce_q4(tensor, group=group, topology=topology, hadamard_block=block)
        assert _same_on_every_rank(tensor, group)
        errors[block] = (float((tensor.double() - exact).norm()), zcomm.comm_stats())
    assert errors[64][0] < 0.7 * errors[None][0], errors
    assert errors[64][1] == errors[None][1]


def _check_async_in_flight(group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
    """Two async calls in flight, a sync one between them, waited in reverse order: the same bits as
    three sync calls (the gathers run in wait order, the same on every rank: [Note: all-reduce async])."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    inputs = [make_inputs(340 + index, world, numel, torch.bfloat16)[rank] for index, numel in enumerate((999, 64, 4096))]
    expected = [x.clone() for x in inputs]
    for tensor in expected:
        zcomm.all_reduce_q4(tensor, group=group, topology=topology, pipeline_stages=2)
    got = [x.clone() for x in inputs]
    first = zcomm.all_reduce_q4(got[0], group=group, topology=topology, pipeline_stages=2, async_op=True)
    zcomm.all_reduce_q4(got[1], group=group, topology=topology, pipeline_stages=2)
    last = zcomm.all_reduce_q4(got[2], group=group, topology=topology, pipeline_stages=2, async_op=True)
    last.wait()
    first.wait()
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def _four_rank_main(rank: int, world: int) -> int:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    checked = 0
    for local in (4, 2, 1):
        topology = zcomm.Topology(world_size=4, local_size=local)
        for case in _cases(seed=local):
            _check_case(case, dist.group.WORLD, topology)
            checked += 1
    if rank >= 2:
        with pytest.raises(ValueError, match="not a member"):
            zcomm.all_reduce_q4(torch.zeros(4), group=pairs[0])
    for case in _cases(seed=9):
        if case["dtype"] == torch.float32:
            _check_case(case, pairs[rank // 2], zcomm.Topology(world_size=2, local_size=2))
            checked += 1
    two_by_two = zcomm.Topology(world_size=4, local_size=2)
    _check_prepared(dist.group.WORLD, two_by_two)
    _check_error_feedback_converges(dist.group.WORLD, two_by_two)
    _check_hadamard(dist.group.WORLD, two_by_two)
    _check_async_in_flight(dist.group.WORLD, two_by_two)
    return checked


@pytest.mark.slow
def test_all_reduce_q4_on_four_ranks_within_the_oracle_bound():
    results = run_distributed(_four_rank_main, 4, env={"ZCOMM_LOCAL_SIZE": "2"}, timeout=400)
    assert results == [3 * 12 + 4] * 4


def test_argument_errors(gloo_world):
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        zcomm.all_reduce_q4([1.0])
    with pytest.raises(ValueError, match="dtype torch.float64"):
        zcomm.all_reduce_q4(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        zcomm.all_reduce_q4(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="op must be"):
        zcomm.all_reduce_q4(torch.zeros(4), dist.ReduceOp.MAX)
    with pytest.raises(ValueError, match="gather_bits must be 4, 8 or None"):
        zcomm.all_reduce_q4(torch.zeros(4), gather_bits=2)
    with pytest.raises(ValueError, match="gather_group_size applies to a quantized gather"):
        zcomm.all_reduce_q4(torch.zeros(4), gather_bits=None, gather_group_size=8)
    with pytest.raises(ValueError, match="first_hop_bits"):
        zcomm.all_reduce_q4(torch.zeros(4), first_hop_bits=2)
    with pytest.raises(ValueError, match="prepared all_reduce_q4 got a tensor"):
        zcomm.prepare_all_reduce_q4(torch.zeros(4))(torch.zeros(4, dtype=torch.float16))


def test_one_rank_is_the_quantization_of_the_tensor(gloo_world):
    """One rank: the reduce-scatter's single INT4 hop, then the INT8 gather; AVG over one rank is SUM."""
    tensor = make_inputs(5, 1, 999, torch.float32)[0]
    expected = tensor.clone()
    zcomm.reset_comm_stats()
    zcomm.all_reduce_q4(tensor, dist.ReduceOp.SUM, group_size=32, pipeline_stages=1)
    bound = all_reduce_bound(expected.double().view(1, -1), nodes=1, local=1, stages=1, group_size=32,
                             gather_group_size=256, dtype=torch.float32, divide_by=1, exact=expected.double())
    _assert_within("all_reduce_q4", {}, tensor.double() - expected.double(), bound)
    assert not torch.equal(tensor, expected)  # quantized, so not a copy
    assert zcomm.comm_stats()["reduce_scatter_q4"].total_bytes == sum(qgz_volume(999, 1, 1, 1, 32)) == 0
