"""The FSDP2 adapter (``zcomm.fsdp.enable_zeropp``) for one rank of worlds of 6 to 4096 ranks.

FSDP2 shards every parameter's dim 0 into ``W`` chunks of ``ceil(d0 / W)`` rows (padded), so a
unit's all-gather input is ``s = sum(ceil(d0 / W) * rest)`` elements on every rank, and with
``reshard_after_forward=L`` (its hpZ) it keeps the padded ``W * s`` elements sharded over the
node's ``L`` ranks after forward. One forward and backward then sends, per unit: qwZ's two
hops of an INT8 payload of ``s`` elements, hpZ's node-local ring gather of ``W * s / L``
fp32 elements, and qgZ's two hops of an ``s``-element slice (INT8 first hop: the adapter's
default). Expected bytes are computed here from that layout and the wire format.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zcomm
import zcomm.fsdp
from scale_cases import case_id, cases, fake_rank, op_bytes, payload_bytes

# (dim 0, elements per row) of a block's parameters: Linear(12, 10), LayerNorm(10), Linear(10, 12)
BLOCK_PARAMS = ((10, 12), (10, 1), (10, 1), (10, 1), (12, 10), (12, 1))
LAYOUTS = ((6, 2), (12, 2), (24, 8), (384, 8), (2048, 2), (2048, 8), (4096, 8), (2040, 8))


def _block() -> nn.Module:
    return nn.Sequential(nn.Linear(12, 10), nn.LayerNorm(10), nn.Linear(10, 12))


def _shard_numel(world: int) -> int:
    return sum(-(-d0 // world) * rest for d0, rest in BLOCK_PARAMS)


def _qgz_stages(world: int, local: int, shard: int) -> int:
    """zcomm's default stage count for a ``W * shard``-element fp32 input (``zcomm._pipeline``: one per 8 MiB,
    at most 4 and one per slice element, only with two hops)."""
    if local == 1 or world == local:
        return 1
    return max(1, min(4, world * shard * 4 // (8 << 20), shard))


@pytest.mark.parametrize("case", cases(LAYOUTS), ids=case_id)
def test_enable_zeropp_bytes_per_unit(case):
    world, local, rank = case
    nodes, blocks = world // local, 3
    with fake_rank(rank, world):
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = nn.Sequential(*(_block() for _ in range(blocks)))
        for block in model:
            fully_shard(block, mesh=mesh, reshard_after_forward=local)
        fully_shard(model, mesh=mesh)
        aligned = zcomm.fsdp.enable_zeropp(model, topology=zcomm.Topology(world_size=world, local_size=local),
                                           align_blocks=False)
        assert aligned == {str(i): False for i in range(blocks)}
        shard = _shard_numel(world)
        assert [p.to_local().numel() for p in model[0].parameters()] == [
            min(-(-d0 // world), max(0, d0 - rank * -(-d0 // world))) * rest for d0, rest in BLOCK_PARAMS]
        zcomm.reset_comm_stats()
        model(torch.randn(4, 12)).pow(2).mean().backward()
        qwz = payload_bytes(shard, 8)
        assert op_bytes("all_gather_q8") == (blocks, blocks * (local - 1) * nodes * qwz, blocks * (nodes - 1) * qwz)
        assert op_bytes("all_gather_into_tensor") == (blocks, blocks * (local - 1) * world * shard // local * 4, 0)
        k = _qgz_stages(world, local, shard)
        part = -(-shard // k)
        intra = k * (local - 1) * payload_bytes(nodes * part, 8)
        assert op_bytes("reduce_scatter_q4") == (blocks, blocks * intra, blocks * k * (nodes - 1) * payload_bytes(part, 4))
        for param in model.parameters():
            assert param.grad is not None and param.grad.to_local().shape == param.to_local().shape
