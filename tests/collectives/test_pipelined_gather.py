"""all_gather_q8 pipelined in chunks ([Note: qwZ pipeline]): bit-identical to the unpipelined form.

Chunks are whole quantization groups, so every element keeps its group, scale and code: the
output of any ``pipeline_stages`` must equal, bit for bit, that of ``pipeline_stages=1``
(itself checked against the flat algorithm and torch in ``test_collectives.py``). Checked
on 4 gloo ranks as 2 nodes x 2, 4 x 1 and 1 x 4, sync and async, for sizes with a short
last group, group sizes that are not multiples of 4 (the chunks' payloads then carry
alignment padding: ``comm_stats`` must count it), ``"tensor"`` (one group: one stage), and
more stages than groups.
"""

from __future__ import annotations

from itertools import product

import pytest
import torch
import torch.distributed as dist

import zcomm
from collective_checks import DTYPES, make_inputs
from collective_oracles import payload_bytes
from spawn_harness import run_distributed
from zcomm.all_gather_q8 import GATHER_STAGE_BYTES, default_pipeline_stages
from zcomm.reduce_scatter_q4 import MAX_DEFAULT_STAGES

SIZES = (1, 13, 4099, 3 * 2048 + 5)
GROUP_SIZES = (None, 6, 30, "tensor")
STAGES = (2, 3, 7)


def _chunk_numels(numel: int, group_size: int, stages: int) -> list[int]:
    """The chunks the docstring promises: ``min(stages, groups)`` runs of whole groups, as even as possible."""
    groups = -(-numel // group_size)
    stages = min(stages, groups)
    bounds = [min(numel, s * groups // stages * group_size) for s in range(stages)] + [numel]
    return [hi - lo for lo, hi in zip(bounds, bounds[1:], strict=False)]


def _check(rank: int, world: int, topology: zcomm.Topology, index: int, case: tuple) -> None:
    numel, group_size, stages, dtype, async_op = case
    inputs = make_inputs(1000 + index, world, numel, dtype)
    unpipelined = torch.empty(world * numel, dtype=dtype)
    zcomm.all_gather_q8(unpipelined, inputs[rank].clone(), group_size=group_size, pipeline_stages=1, topology=topology)
    pipelined = torch.empty(world * numel, dtype=dtype)
    zcomm.reset_comm_stats()
    handle = zcomm.all_gather_q8(
        pipelined, inputs[rank].clone(), async_op=async_op, group_size=group_size, pipeline_stages=stages,
        topology=topology,
    )
    if async_op:
        handle.wait()
    assert torch.equal(pipelined.view(torch.uint8), unpipelined.view(torch.uint8)), (topology, case)
    concrete = max(2, numel) if group_size == "tensor" else (group_size or zcomm.quant.DEFAULT_GROUP_SIZE[8])
    payload = sum(payload_bytes(n, 8, concrete) for n in _chunk_numels(numel, concrete, stages))
    nodes, local = topology.num_nodes, topology.local_size
    stats = zcomm.comm_stats()["all_gather_q8"]
    assert (stats.intra_bytes, stats.inter_bytes) == ((local - 1) * nodes * payload, (nodes - 1) * payload), case


def _main(rank: int, world: int) -> int:
    checked = 0
    for local in (2, 1, 4):
        topology = zcomm.Topology(world_size=world, local_size=local)
        cases = product(SIZES, GROUP_SIZES, STAGES)
        for index, (numel, group_size, stages) in enumerate(cases):
            if local != 2 and index % 3:
                continue  # single-hop layouts: a third of the cases
            dtype, async_op = DTYPES[index % len(DTYPES)], index % 2 == 1
            _check(rank, world, topology, index, (numel, group_size, stages, dtype, async_op))
            checked += 1
    dist.barrier()
    return checked


@pytest.mark.slow
def test_pipelined_all_gather_q8_is_bit_identical_to_one_stage():
    full = len(SIZES) * len(GROUP_SIZES) * len(STAGES)
    single_hop = len(range(0, full, 3))
    assert run_distributed(_main, 4, timeout=300) == [full + 2 * single_hop] * 4


def test_chunks_are_whole_groups_as_even_as_possible():
    assert _chunk_numels(10 * 8 + 3, 8, 3) == [24, 32, 27]  # 11 groups: 3, 4, 4
    assert _chunk_numels(5, 8, 4) == [5]  # one group: one stage


def test_default_pipeline_stages_of_all_gather_q8():
    two_by_two = zcomm.Topology(world_size=4, local_size=2)
    assert default_pipeline_stages(64 << 20, 1 << 14, two_by_two) == MAX_DEFAULT_STAGES
    assert default_pipeline_stages(16 << 20, 1 << 14, two_by_two) == 4
    assert default_pipeline_stages(2 * GATHER_STAGE_BYTES, 1 << 14, two_by_two) == 2
    assert default_pipeline_stages(64 << 20, 3, two_by_two) == 3  # at most one stage per group
    assert default_pipeline_stages(GATHER_STAGE_BYTES - 1, 1 << 14, two_by_two) == 1
    # nothing to overlap with a single hop
    assert default_pipeline_stages(64 << 20, 1 << 14, zcomm.Topology(world_size=4, local_size=4)) == 1
    assert default_pipeline_stages(64 << 20, 1 << 14, zcomm.Topology(world_size=4, local_size=1)) == 1
