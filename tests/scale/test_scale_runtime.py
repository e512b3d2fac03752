"""zero_runtime's ZeRO-3 and ZeRO++ (qwZ, hpZ, qgZ) for one rank of worlds of 6 to 4096 ranks.

``initialize`` and two optimizer steps of a model of tiny, odd-sized parameters (a 32-element
vector: DeepSpeed #6659's IndexError at world 2048 with hpZ 16; sizes that are not multiples
of 8: #4309; odd node counts: #5054), then the layout of every unit, ``memory_report()`` and
the second step's bytes, each against what the ZeRO layout and zcomm's byte model give,
computed here. The config makes every unit partitioned, one unit per module, one gradient
bucket, and frees every unit after each use (no prefetch, reuse distance 0), so each step
gathers every unit in forward and again in backward (hpZ: from its secondary).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import zcomm
import zero_runtime
from scale_cases import LAYOUTS, case_id, cases, fake_rank, op_bytes, payload_bytes, ring_bytes

HPZ_SIZES = (2, 3, 4, 8, 16)
STAGE3 = {"stage": 3, "zcomm_stage3_fuse_numel": 0, "stage3_param_persistence_threshold": 0,
          "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


class _Odd(nn.Module):
    """Units (one per module): ``vec`` (32), ``lin1`` (35 + 5), ``norm`` (5 + 5), ``lin2`` (15)."""

    def __init__(self) -> None:
        super().__init__()
        self.vec = nn.Parameter(torch.randn(32))
        self.lin1, self.norm, self.lin2 = nn.Linear(7, 5), nn.LayerNorm(5), nn.Linear(5, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.norm(self.lin1(x))).float().pow(2).mean() + self.vec.float().square().mean()


UNIT_NUMELS = (32, 40, 10, 15)


def _valid_hpz(world: int, local: int) -> list[int]:
    """hpZ sizes whose blocks of consecutive ranks line up with nodes."""
    return [h for h in HPZ_SIZES if world % h == 0 and (local % h == 0 or h % local == 0)]


def _zeropp_cases() -> list[tuple[int, int, int, int]]:
    """Every layout's three ranks with hpZ the node size (2 for one rank per node), and every other valid
    hpZ size at a middle rank; world 2048 with hpZ 16 is DeepSpeed #6659's case."""
    found = [(w, l, r, l if l > 1 else 2) for w, l, r in cases()]
    for world, local in LAYOUTS:
        middle = world // 2 + 3 if world > 8 else world // 2
        found += [(world, local, middle, h) for h in _valid_hpz(world, local) if h != (local if local > 1 else 2)]
    return found


def _train(world: int, local: int, rank: int, zero: dict) -> tuple[zero_runtime.ZeroOptimizer, list]:
    torch.manual_seed(0)
    model = _Odd()
    config = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {**STAGE3, **zero}}
    model, opt = zero_runtime.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-3), config,
                                         topology=zcomm.Topology(world_size=world, local_size=local))
    for _ in range(2):
        zcomm.reset_comm_stats()
        opt.backward(model(torch.randn(2, 7)))
        opt.step()
        opt.zero_grad()
    return opt, [u.layout.numel for u in opt.units]


def _check_layout(opt: zero_runtime.ZeroOptimizer, world: int, rank: int) -> int:
    """Each unit packed (aligning it would cost far over 1/32) and padded to a multiple of the world;
    returns the elements of this rank's shards."""
    assert [u.names for u in opt.units] == [("vec",), ("lin1.weight", "lin1.bias"), ("norm.weight", "norm.bias"),
                                           ("lin2.weight",)]
    total = 0
    for unit, numel in zip(opt.units, UNIT_NUMELS, strict=True):
        padded = -(-numel // world) * world
        assert unit.layout.align == 1 and unit.layout.numel == padded
        assert unit.shard.numel() == unit.master.numel() == padded // world
        assert unit.layout.shard_range(rank) == (rank * padded // world, (rank + 1) * padded // world)
        total += padded // world
    return total


@pytest.mark.parametrize("case", cases(), ids=case_id)
def test_zero3_layout_memory_and_step_bytes(case):
    world, local, rank = case
    with fake_rank(rank, world):
        opt, numels = _train(world, local, rank, {})
        shards = _check_layout(opt, world, rank)
        memory = opt.memory_report()
        assert (memory.parameters, memory.gradients) == (2 * shards, 2 * shards)
        assert memory.optimizer_states == 12 * shards + 4 * len(numels)  # fp32 master, two moments; AdamW's step
        assert memory.secondary_parameters == 0
        gathers = [ring_bytes(2 * n // world, rank, world, local) for n in numels]
        expected = tuple(2 * sum(b[i] for b in gathers) for i in (0, 1))  # forward and backward
        assert op_bytes("all_gather_into_tensor") == (2 * len(numels), *expected)
        assert op_bytes("reduce_scatter_tensor") == (1, *ring_bytes(2 * shards, rank, world, local))
        assert set(zcomm.comm_stats()) == {"all_gather_into_tensor", "reduce_scatter_tensor"}


def _block_ring(bytes_each: int, rank: int, hpz: int, local: int) -> tuple[int, int]:
    """A ring all-gather inside rank's hpZ block of ``hpz`` consecutive ranks."""
    start = rank // hpz * hpz
    successor = start + (rank - start + 1) % hpz
    sent = (hpz - 1) * bytes_each
    return (sent, 0) if rank // local == successor // local else (0, sent)


@pytest.mark.parametrize("case", _zeropp_cases(), ids=case_id)
def test_zeropp_layout_memory_and_step_bytes(case):
    world, local, rank, hpz = case
    nodes = world // local
    zero = {"zero_quantized_weights": True, "zero_hpz_partition_size": hpz, "zero_quantized_gradients": True}
    with fake_rank(rank, world):
        opt, numels = _train(world, local, rank, zero)
        shards = _check_layout(opt, world, rank)
        memory = opt.memory_report()
        assert (memory.parameters, memory.gradients) == (2 * shards, 2 * shards)
        assert memory.secondary_parameters == sum(2 * n // hpz for n in numels)  # every unit freed after forward
        qwz = [payload_bytes(n // world, 8) for n in numels]
        assert op_bytes("all_gather_q8") == (len(numels), sum((local - 1) * nodes * p for p in qwz),
                                             sum((nodes - 1) * p for p in qwz))
        hpz_gathers = [_block_ring(2 * n // hpz, rank, hpz, local) for n in numels]
        assert op_bytes("all_gather_into_tensor") == (len(numels), *(sum(b[i] for b in hpz_gathers) for i in (0, 1)))
        # one bucket of every unit: this rank's slice is its shards end to end; one stage (a tiny input)
        intra = (local - 1) * payload_bytes(nodes * shards, 4) if local > 1 else 0
        assert op_bytes("reduce_scatter_q4") == (1, intra, (nodes - 1) * payload_bytes(shards, 4))
        assert set(zcomm.comm_stats()) == {"all_gather_q8", "all_gather_into_tensor", "reduce_scatter_q4"}
        assert all(torch.isfinite(u.master).all() for u in opt.units)


def test_the_cases_cover_hpz_2_to_16_and_deepspeed_6659():
    covered = {case[3] for case in _zeropp_cases()}
    assert covered == set(HPZ_SIZES)
    assert any(case[0] == 2048 and case[3] == 16 for case in _zeropp_cases())


@pytest.mark.parametrize("case", [(24, 8, 13), (384, 8, 383), (2048, 8, 1027), (4096, 1, 0), (2040, 8, 2039)],
                         ids=case_id)
def test_zeropp_with_loco_error_buffers(case):
    """LoCo's INT8 errors are not partitioned: hop 1's over the whole reordered input (``W x`` this
    rank's slice), hop 2's over the ``N`` node sums (none with one rank per node)."""
    world, local, rank = case
    nodes = world // local
    zero = {"zero_quantized_weights": True, "zero_hpz_partition_size": local if local > 1 else 2,
            "zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}}
    with fake_rank(rank, world):
        opt, _ = _train(world, local, rank, zero)
        shards = _check_layout(opt, world, rank)
        hop2 = payload_bytes(nodes * shards, 8) if local > 1 and nodes > 1 else 0
        assert opt.memory_report().error_feedback == payload_bytes(world * shards, 8) + hop2
        intra = (local - 1) * payload_bytes(nodes * shards, 4) if local > 1 else 0
        assert op_bytes("reduce_scatter_q4") == (1, intra, (nodes - 1) * payload_bytes(shards, 4))
