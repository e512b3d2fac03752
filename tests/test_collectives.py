"""all_gather_q8 / reduce_scatter_q4 on real gloo process groups, against torch.distributed.

Each spawn runs many sub-cases: topologies 1x2 (a subgroup), 1x4, 2x2, 4x1 and 2x3 (from
ZCOMM_LOCAL_SIZE); sizes below the world size, primes and sizes that do not divide the
group size; fp32/bf16/fp16; SUM and AVG; sync and async; 1-4 pipeline stages. Outputs are
compared with torch.distributed collectives on fp64 copies, within the per-element bounds
of ``collective_oracles`` (derived there), and ``comm_stats()`` with the analytic volumes.
The hierarchical all_gather_q8 must also equal, bit for bit, the flat algorithm (the same
payloads in one all-gather on the caller's group, dequantized in rank order).
"""

from __future__ import annotations

import os
import random
from itertools import product

import pytest
import torch
import torch.distributed as dist

import zcomm
from collective_oracles import all_gather_bound, qgz_volume, qwz_volume, reduce_scatter_bound, ring_volume
from spawn_harness import run_distributed

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
SIZES = (0, 1, 2, 3, 13, 97, 1031, 4099)  # per-rank slice (reduce-scatter) / input (all-gather) numel
GROUP_SIZES = (None, 6, 8, 30)
DEFAULT_GROUP_SIZES = {"all_gather_q8": 2048, "reduce_scatter_q4": 512}


def _cases(seed: int):
    """Every (dtype, op, async) combination once, with sizes, stages and group sizes varied over them."""
    rng = random.Random(seed)
    sizes = list(SIZES)
    rng.shuffle(sizes)
    for index, (dtype, op, async_op) in enumerate(product(DTYPES, OPS, (False, True))):
        yield dict(
            dtype=dtype,
            op=op,
            async_op=async_op,
            slice_numel=sizes[index % len(sizes)],
            stages=1 + index % 4,
            group_size=rng.choice(GROUP_SIZES),
            seed=seed * 100 + index,
        )


def _inputs(seed: int, world: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """All ranks' inputs (every rank builds the same ones), heavy-tailed so group scales differ."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(world, numel, generator=gen) * torch.exp(torch.randn(world, numel, generator=gen))
    return values.to(dtype)


def _check_case(case: dict, group: dist.ProcessGroup, topology: zcomm.Topology, *, detect: bool = False) -> None:
    """One sub-case; ``detect`` leaves the topology to the collectives (``topology`` is then what they should find)."""
    given = None if detect else topology
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtype, m, stages, gs = case["dtype"], case["slice_numel"], case["stages"], case["group_size"]
    divide_by = world if case["op"] == dist.ReduceOp.AVG else 1
    inputs = _inputs(case["seed"], world, world * m, dtype)
    gathered_inputs = inputs[:, :m].contiguous()
    reduced = torch.empty(m, dtype=dtype)
    gathered = torch.empty(world * m, dtype=dtype)
    zcomm.reset_comm_stats()
    handles = [
        zcomm.reduce_scatter_q4(
            reduced, inputs[rank].clone(), case["op"], group, case["async_op"],
            group_size=gs, pipeline_stages=stages, topology=given,
        ),
        zcomm.all_gather_q8(
            gathered, gathered_inputs[rank].clone(), group, case["async_op"], group_size=gs, topology=given
        ),
    ]
    if case["async_op"]:
        for handle in handles:
            handle.wait()
            assert handle.is_completed()
    else:
        assert handles == [None, None]

    summed = inputs[rank].double()
    dist.all_reduce(summed, group=group)  # gloo's AVG is unreliable: sum in fp64 and divide here
    exact = summed[rank * m : (rank + 1) * m] / divide_by
    rs_gs = gs or DEFAULT_GROUP_SIZES["reduce_scatter_q4"]
    bound = reduce_scatter_bound(
        inputs.double(), rank, nodes=topology.num_nodes, local=topology.local_size, stages=stages,
        group_size=rs_gs, dtype=dtype, divide_by=divide_by, exact=exact,
    )
    _assert_within("reduce_scatter_q4", case, reduced.double() - exact, bound)

    expected = [torch.empty(m, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(expected, gathered_inputs[rank].double(), group=group)
    ag_gs = gs or DEFAULT_GROUP_SIZES["all_gather_q8"]
    bound = all_gather_bound(torch.stack(expected), ag_gs, dtype).view(-1)
    _assert_within("all_gather_q8", case, gathered.double() - torch.cat(expected), bound)
    flat = _flat_all_gather_q8(gathered_inputs[rank], group, ag_gs)
    assert torch.equal(gathered, flat), ("all_gather_q8 differs from the flat quantize/all-gather/dequantize", case)

    _assert_stats("reduce_scatter_q4", qgz_volume(m, topology.num_nodes, topology.local_size, stages, rs_gs), case)
    _assert_stats("all_gather_q8", qwz_volume(m, topology.num_nodes, topology.local_size, ag_gs), case)


def _flat_all_gather_q8(input: torch.Tensor, group: dist.ProcessGroup, group_size: int) -> torch.Tensor:
    """The one-hop algorithm the hierarchical all_gather_q8 must reproduce bit for bit:
    the same payloads, gathered by torch in rank order, dequantized together."""
    world = dist.get_world_size(group)
    payload = zcomm.quant.quantize(input, 8, group_size)
    rows = torch.empty(world, payload.numel(), dtype=torch.uint8)
    dist.all_gather(list(rows.unbind(0)), payload, group=group)
    return zcomm.quant.dequantize(rows, input.numel(), 8, group_size, input.dtype)


def _assert_stats(name: str, volume: tuple[int, int], context: object) -> None:
    """comm_stats() holds exactly one call of ``name`` that sent ``volume`` = (intra, inter) bytes."""
    stats = zcomm.comm_stats()[name]
    assert (stats.calls, stats.intra_bytes, stats.inter_bytes) == (1, *volume), (name, context)


def _assert_within(name: str, case: dict, error: torch.Tensor, bound: torch.Tensor) -> None:
    excess = error.abs() - bound
    if excess.numel() and bool((excess > 0).any()):
        worst = int(excess.argmax())
        raise AssertionError(
            f"{name} {case}: |error| {float(error.abs()[worst])} > bound {float(bound[worst])} at element {worst}"
        )


def _check_avg_divides_by_world(group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
    """AVG and SUM share every quantization step, so in fp32 AVG x W must equal SUM to one rounding.

    Both calls are in flight together, so this also checks that queued async calls keep their buffers apart.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    inputs = _inputs(7, world, world * 300, torch.float32)
    outputs = {op: torch.empty(300) for op in OPS}
    handles = [
        zcomm.reduce_scatter_q4(out, inputs[rank].clone(), op, group, True, pipeline_stages=2, topology=topology)
        for op, out in outputs.items()
    ]
    for handle in handles:
        handle.wait()
    total = outputs[dist.ReduceOp.SUM].double()
    assert torch.all((outputs[dist.ReduceOp.AVG].double() * world - total).abs() <= total.abs() * 2.0**-23)


def _check_plain_collectives(group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    inputs = _inputs(11, world, world * 5, torch.float32)
    zcomm.reset_comm_stats()
    gathered = torch.empty(world * 5)
    zcomm.all_gather_into_tensor(gathered, inputs[rank, :5].clone(), group, topology=topology)
    assert torch.equal(gathered.view(world, 5), inputs[:, :5])
    reduced = torch.empty(5)
    zcomm.reduce_scatter_tensor(reduced, inputs[rank].clone(), group=group, topology=topology)
    exact = inputs.double().sum(0)[rank * 5 : (rank + 1) * 5]
    torch.testing.assert_close(reduced.double(), exact, rtol=1e-6, atol=1e-6)  # plain fp32 ring sums
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        _assert_stats(name, ring_volume(5 * 4, rank, world, topology.local_size), topology)


def _check_errors(topology: zcomm.Topology) -> None:
    world = topology.world_size
    x, out = torch.randn(world * 4), torch.empty(4)
    rs = zcomm.reduce_scatter_q4
    with pytest.raises(ValueError, match="input must be contiguous"):
        rs(out, torch.randn(world * 8)[::2], topology=topology)
    with pytest.raises(ValueError, match="numel"):
        rs(torch.empty(5), x, topology=topology)
    with pytest.raises(ValueError, match="numel"):
        zcomm.all_gather_q8(torch.empty(world * 4 + 1), out, topology=topology)
    with pytest.raises(ValueError, match="dtypes differ"):
        rs(out.half(), x, topology=topology)
    with pytest.raises(ValueError, match="float64"):
        zcomm.all_gather_q8(torch.empty(world * 4, dtype=torch.float64), out.double(), topology=topology)
    with pytest.raises(ValueError, match="op must be ReduceOp.SUM or ReduceOp.AVG"):
        rs(out, x, dist.ReduceOp.MAX, topology=topology)
    with pytest.raises(ValueError, match="pipeline_stages"):
        rs(out, x, pipeline_stages=0, topology=topology)
    with pytest.raises(ValueError, match="group_size must be an even"):
        rs(out, x, group_size=7, topology=topology)
    with pytest.raises(ValueError, match="topology is for 2 ranks but the group has 4"):
        rs(out, x, topology=zcomm.Topology(world_size=2, local_size=1))


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
        for case in _cases(seed=local):
            _check_case(case, dist.group.WORLD, topology)
            checked += 1
        _check_avg_divides_by_world(dist.group.WORLD, topology)
        _check_plain_collectives(dist.group.WORLD, topology)
    pair_topology = zcomm.Topology(world_size=2, local_size=2)
    for case in _cases(seed=12):
        _check_case(case, pairs[rank // 2], pair_topology)
        checked += 1
    _check_errors(zcomm.Topology(world_size=4, local_size=2))
    block = zcomm.consecutive_group(None, 2)
    assert dist.get_process_group_ranks(block) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert zcomm.consecutive_group(None, 2) is block
    return checked


def _six_rank_main(rank: int, world: int) -> int:
    assert zcomm.Topology.detect() == zcomm.Topology(world_size=6, local_size=3)
    topology = zcomm.Topology(world_size=6, local_size=3)
    checked = 0
    for case in _cases(seed=23):
        # topology=None: the collectives must find 2x3 themselves (comm_stats checks the volumes)
        _check_case(case, dist.group.WORLD, topology, detect=not case["async_op"])
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
    assert run_distributed(_four_rank_main, 4, timeout=240) == [4 * 12] * 4


@pytest.mark.slow
def test_six_ranks_2x3_from_zcomm_local_size():
    assert run_distributed(_six_rank_main, 6, env={"ZCOMM_LOCAL_SIZE": "3"}, timeout=240) == [12] * 6


@pytest.mark.slow
def test_dead_peer_makes_the_others_fail_with_the_timeout_error():
    results = run_distributed(_dead_peer_main, 4, pg_timeout=10, may_exit=(3,), timeout=120)
    assert results[3] is None
    for rank in range(3):
        assert all(entry.startswith("RuntimeError") for entry in results[rank]), (rank, results[rank])
