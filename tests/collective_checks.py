"""Checks of the zcomm collectives against torch.distributed, shared by the multi-rank tests.

Each sub-case (:func:`cases`) runs ``reduce_scatter_q4`` and ``all_gather_q8`` on one
process group and compares them with torch.distributed collectives on fp64 copies, within
the per-element bounds of ``collective_oracles`` (derived there), and ``comm_stats()`` with
the analytic volumes. The hierarchical all_gather_q8 must also equal, bit for bit, the flat
algorithm (the same payloads in one all-gather on the caller's group, dequantized in rank
order). Tensors live on ``device`` (CPU with gloo, CUDA with NCCL).
"""

from __future__ import annotations

import random
from itertools import product

import torch
import torch.distributed as dist

import zcomm
from collective_oracles import all_gather_bound, qgz_volume, qwz_volume, reduce_scatter_bound, ring_volume

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)
SIZES = (0, 1, 2, 3, 13, 97, 1031, 4099)  # per-rank slice (reduce-scatter) / input (all-gather) numel
GROUP_SIZES = (None, 6, 8, 30)
DEFAULT_GROUP_SIZES = {"all_gather_q8": 256, "reduce_scatter_q4": 256}
TENSOR_SIZES = (0, 1, 97, 4099)  # group_size="tensor": 4099 exceeds both default group sizes


def cases(seed: int):
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
            first_hop_bits=8 if index % 3 == 2 else 4,  # reduce_scatter_q4's INT8 intra-node hop
        )


def tensor_cases(seed: int):
    """``group_size="tensor"`` (one scale per payload row) in both collectives: empty to beyond both
    default group sizes, every dtype, SUM and AVG, sync and async, 1-3 pipeline stages."""
    for index, slice_numel in enumerate(TENSOR_SIZES):
        yield dict(
            dtype=DTYPES[index % len(DTYPES)],
            op=OPS[index % len(OPS)],
            async_op=index >= len(TENSOR_SIZES) // 2,
            slice_numel=slice_numel,
            stages=1 + index % 3,
            group_size="tensor",
            seed=seed * 100 + 50 + index,
            first_hop_bits=4,
        )


def make_inputs(seed: int, world: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """All ranks' inputs (every rank builds the same ones), heavy-tailed so group scales differ."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(world, numel, generator=gen) * torch.exp(torch.randn(world, numel, generator=gen))
    return values.to(dtype)


def check_case(
    case: dict, group: dist.ProcessGroup, topology: zcomm.Topology, *, detect: bool = False, device: str = "cpu"
) -> None:
    """One sub-case; ``detect`` leaves the topology to the collectives (``topology`` is then what they should find)."""
    given = None if detect else topology
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtype, m, stages, gs = case["dtype"], case["slice_numel"], case["stages"], case["group_size"]
    divide_by = world if case["op"] == dist.ReduceOp.AVG else 1
    inputs = make_inputs(case["seed"], world, world * m, dtype)
    gathered_inputs = inputs[:, :m].contiguous()
    reduced = torch.empty(m, dtype=dtype, device=device)
    gathered = torch.empty(world * m, dtype=dtype, device=device)
    zcomm.reset_comm_stats()
    handles = [
        zcomm.reduce_scatter_q4(
            reduced, inputs[rank].to(device, copy=True), case["op"], group, case["async_op"],
            group_size=gs, pipeline_stages=stages, topology=given, first_hop_bits=case["first_hop_bits"],
        ),
        zcomm.all_gather_q8(
            gathered, gathered_inputs[rank].to(device, copy=True), group, case["async_op"],
            group_size=gs, topology=given,
        ),
    ]
    if case["async_op"]:
        for handle in handles:
            handle.wait()
        if reduced.is_cuda:
            torch.cuda.synchronize(reduced.device)  # wait() only ordered the current stream after the chain
        assert all(handle.is_completed() for handle in handles), case
    else:
        assert handles == [None, None]
    reduced, gathered = reduced.cpu(), gathered.cpu()

    summed = inputs[rank].double().to(device)
    dist.all_reduce(summed, group=group)  # gloo's AVG is unreliable: sum in fp64 and divide here
    exact = summed.cpu()[rank * m : (rank + 1) * m] / divide_by
    part = -(-m // stages)
    rs_gs = _oracle_group_size(gs, "reduce_scatter_q4", longest_row=topology.num_nodes * part)
    first_bits = case["first_hop_bits"] if topology.local_size > 1 else 4  # step 1 crosses nodes otherwise
    bound = reduce_scatter_bound(
        inputs.double(), rank, nodes=topology.num_nodes, local=topology.local_size, stages=stages,
        group_size=rs_gs, dtype=dtype, divide_by=divide_by, exact=exact, first_bits=first_bits,
    )
    _assert_within("reduce_scatter_q4", case, reduced.double() - exact, bound)

    expected = torch.empty(world, m, dtype=torch.float64, device=device)
    dist.all_gather(list(expected.unbind(0)), gathered_inputs[rank].double().to(device), group=group)
    expected = expected.cpu()
    ag_gs = _oracle_group_size(gs, "all_gather_q8", longest_row=m)
    bound = all_gather_bound(expected, ag_gs, dtype).view(-1)
    _assert_within("all_gather_q8", case, gathered.double() - expected.view(-1), bound)
    flat = _flat_all_gather_q8(gathered_inputs[rank].to(device), group, ag_gs).cpu()
    assert torch.equal(gathered, flat), ("all_gather_q8 differs from the flat quantize/all-gather/dequantize", case)

    assert_stats("reduce_scatter_q4",
                 qgz_volume(m, topology.num_nodes, topology.local_size, stages, rs_gs, first_bits=first_bits), case)
    assert_stats("all_gather_q8", qwz_volume(m, topology.num_nodes, topology.local_size, ag_gs), case)


def _oracle_group_size(setting: int | str | None, name: str, *, longest_row: int) -> int:
    """The group size the oracles compute with: ``"tensor"`` is one scale per payload row, which any
    group size covering the longest row gives (rows: all_gather_q8's input; reduce_scatter_q4's
    intra-node rows of N pipeline parts); None is the collective's default."""
    if setting == "tensor":
        return max(2, longest_row)
    return DEFAULT_GROUP_SIZES[name] if setting is None else setting


def _flat_all_gather_q8(input: torch.Tensor, group: dist.ProcessGroup, group_size: int) -> torch.Tensor:
    """The one-hop algorithm the hierarchical all_gather_q8 must reproduce bit for bit:
    the same payloads, gathered by torch in rank order, dequantized together."""
    world = dist.get_world_size(group)
    payload = zcomm.quant.quantize(input, 8, group_size)
    rows = torch.empty(world, payload.numel(), dtype=torch.uint8, device=input.device)
    dist.all_gather(list(rows.unbind(0)), payload, group=group)
    return zcomm.quant.dequantize(rows, input.numel(), 8, group_size, input.dtype)


def assert_stats(name: str, volume: tuple[int, int], context: object) -> None:
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


def check_plain_collectives(
    group: dist.ProcessGroup, topology: zcomm.Topology, *, device: str = "cpu", async_op: bool = False
) -> None:
    """The counted pass-throughs: torch's results (exact gather, fp32 sums) and the ring volumes."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    inputs = make_inputs(11, world, world * 5, torch.float32)
    zcomm.reset_comm_stats()
    gathered = torch.empty(world * 5, device=device)
    reduced = torch.empty(5, device=device)
    mine = inputs[rank].to(device, copy=True)
    works = [
        zcomm.all_gather_into_tensor(gathered, mine[:5].clone(), group, async_op, topology=topology),
        zcomm.reduce_scatter_tensor(reduced, mine, group=group, async_op=async_op, topology=topology),
    ]
    for work in works:
        if async_op:
            work.wait()
    assert torch.equal(gathered.cpu().view(world, 5), inputs[:, :5])
    exact = inputs.double().sum(0)[rank * 5 : (rank + 1) * 5]
    torch.testing.assert_close(reduced.cpu().double(), exact, rtol=1e-6, atol=1e-6)  # plain fp32 ring sums
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        assert_stats(name, ring_volume(5 * 4, rank, world, topology.local_size), topology)


