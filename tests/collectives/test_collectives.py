"""all_gather_q8 / reduce_scatter_q4 on real gloo process groups, against torch.distributed.

Each spawn runs many sub-cases (``collective_checks``): topologies 1x2 (a subgroup), 1x4,
2x2, 4x1 and 2x3 (from ZCOMM_LOCAL_SIZE); sizes below the world size, primes and sizes
that do not divide the group size; group sizes None, ints and ``"tensor"``; fp32/bf16/fp16;
SUM and AVG; sync and async; 1-4 pipeline stages. The argument checks run on one rank in
``test_prologue.py``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import zcomm
from collective_checks import OPS, cases, check_case, check_plain_collectives, make_inputs, tensor_cases
from spawn_harness import run_distributed


def _check_avg_divides_by_world(group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
    """AVG and SUM share every quantization step, so in fp32 AVG x W must equal SUM to one rounding.

    Both calls are in flight together, so this also checks that queued async calls keep their buffers apart.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    inputs = make_inputs(7, world, world * 300, torch.float32)
    outputs = {op: torch.empty(300) for op in OPS}
    handles = [
        zcomm.reduce_scatter_q4(out, inputs[rank].clone(), op, group, True, pipeline_stages=2, topology=topology)
        for op, out in outputs.items()
    ]
    for handle in handles:
        handle.wait()
    total = outputs[dist.ReduceOp.SUM].double()
    assert torch.all((outputs[dist.ReduceOp.AVG].double() * world - total).abs() <= total.abs() * 2.0**-23)


def _check_detection(rank: int, world: int, triple: dist.ProcessGroup | None, evens: dist.ProcessGroup | None) -> None:
    variables = ("ZCOMM_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    saved = {v: os.environ.pop(v, None) for v in variables}
    try:
        # no variable: host names are exchanged, and all ranks run on this machine
        assert zcomm.Topology.detect() == zcomm.Topology(world_size=4, local_size=4)
        settings = [("MPI_LOCALNRANKS", "1", 1), ("OMPI_COMM_WORLD_LOCAL_SIZE", "4", 4), ("LOCAL_WORLD_SIZE", "2", 2)]
        for variable, value, local in settings:  # each one set overrides the ones set before
            os.environ[variable] = value
            assert zcomm.Topology.detect() == zcomm.Topology(world_size=4, local_size=local), variable
        os.environ["ZCOMM_LOCAL_SIZE"] = "1"  # overrides LOCAL_WORLD_SIZE=2
        assert zcomm.Topology.detect() == zcomm.Topology(world_size=4, local_size=1)
        os.environ["ZCOMM_LOCAL_SIZE"] = "2"
        if evens is not None:  # global ranks 0 and 2 sit on nodes 0 and 1
            assert zcomm.Topology.detect(evens) == zcomm.Topology(world_size=2, local_size=1)
        if triple is not None:  # global ranks 0, 1, 2: two on node 0, one on node 1
            with pytest.raises(ValueError, match="unequal numbers of ranks"):
                zcomm.Topology.detect(triple)
        os.environ["ZCOMM_LOCAL_SIZE"] = "3"
        with pytest.raises(ValueError, match=r"world size 4 is not divisible by the local size 3 read from \$ZCOMM"):
            zcomm.Topology.detect()
        with pytest.raises(ValueError, match="not divisible by the local size 3"):
            zcomm.all_gather_q8(torch.empty(8), torch.empty(2))
    finally:
        for variable, value in saved.items():
            os.environ.pop(variable, None)
            if value is not None:
                os.environ[variable] = value


def _four_rank_main(rank: int, world: int) -> int:
    # every rank creates every subgroup, in the same order, as torch requires of new_group
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    triple = dist.new_group([0, 1, 2])
    evens = dist.new_group([0, 2])
    _check_detection(rank, world, triple if rank < 3 else None, evens if rank % 2 == 0 else None)
    checked = 0
    for local in (4, 2, 1):
        topology = zcomm.Topology(world_size=4, local_size=local)
        for case in (*cases(seed=local), *tensor_cases(seed=local)):
            check_case(case, dist.group.WORLD, topology)
            checked += 1
        _check_avg_divides_by_world(dist.group.WORLD, topology)
        check_plain_collectives(dist.group.WORLD, topology)
    pair_topology = zcomm.Topology(world_size=2, local_size=2)
    for case in cases(seed=12):
        check_case(case, pairs[rank // 2], pair_topology)
        checked += 1
    block = zcomm.consecutive_group(None, 2)
    assert dist.get_process_group_ranks(block) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert zcomm.consecutive_group(None, 2) is block
    return checked


def _six_rank_main(rank: int, world: int) -> int:
    assert zcomm.Topology.detect() == zcomm.Topology(world_size=6, local_size=3)
    topology = zcomm.Topology(world_size=6, local_size=3)
    checked = 0
    for case in (*cases(seed=23), *tensor_cases(seed=23)):
        # topology=None: the collectives must find 2x3 themselves (comm_stats checks the volumes)
        check_case(case, dist.group.WORLD, topology, detect=not case["async_op"])
        checked += 1
    _check_avg_divides_by_world(dist.group.WORLD, topology)
    return checked


def _dead_peer_main(rank: int, world: int) -> list[str]:
    topology = zcomm.Topology(world_size=4, local_size=2)
    out, gathered = torch.empty(64), torch.empty(4 * 64)
    zcomm.reduce_scatter_q4(out, torch.randn(4 * 64), topology=topology, pipeline_stages=2)
    zcomm.all_gather_q8(gathered, out, topology=topology)
    dist.barrier()
    if rank == 3:
        os._exit(0)
    errors = []
    calls = (
        lambda: zcomm.reduce_scatter_q4(out, torch.randn(4 * 64), topology=topology, pipeline_stages=2),
        lambda: zcomm.all_gather_q8(gathered, out, topology=topology),
    )
    for call in calls:
        try:
            call()
            errors.append("no error")
        except RuntimeError as exc:
            errors.append(f"RuntimeError: {type(exc).__name__}")
    return errors


@pytest.mark.slow
def test_four_ranks_1x4_2x2_4x1_and_1x2_subgroups():
    assert run_distributed(_four_rank_main, 4, timeout=240) == [4 * 12 + 3 * 4] * 4


@pytest.mark.slow
def test_six_ranks_2x3_from_zcomm_local_size():
    assert run_distributed(_six_rank_main, 6, env={"ZCOMM_LOCAL_SIZE": "3"}, timeout=240) == [12 + 4] * 6


@pytest.mark.slow
def test_dead_peer_makes_the_others_fail_with_the_timeout_error():
    results = run_distributed(_dead_peer_main, 4, pg_timeout=10, may_exit=(3,), timeout=120)
    assert results[3] is None
    for rank in range(3):
        assert all(entry.startswith("RuntimeError") for entry in results[rank]), (rank, results[rank])
