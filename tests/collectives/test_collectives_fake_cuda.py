"""The counted collectives and zcomm's group creation on fake CUDA tensors and torch's fake process group.

On a CPU machine, torch's ``FakeTensorMode`` makes ``cuda`` tensors without a GPU and torch's
``fake`` backend (``torch.testing._internal.distributed.fake_pg``) plays rank 1 of 4 without
peers. A dispatch mode checks that every tensor the calls create or return is on CUDA.

The quantized collectives' chains need more than ``FakeTensorMode`` on a CPU build of torch
(Python indexing of a fake CUDA tensor enters the CUDA device guard, which a CPU build lacks;
the async path makes CUDA streams and events): they run on the fake CUDA machine of
``tests/fake_cuda.py``, in ``test_collectives_fake_nccl.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import zcomm


class _DeviceAudit(TorchDispatchMode):
    """Records every aten call whose result holds a tensor that is not on CUDA."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.off_device: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.calls += 1
        for value in tree_flatten(result)[0]:
            if isinstance(value, torch.Tensor) and value.device.type != "cuda":
                self.off_device.append(f"{func} -> {value.device}")
        return result


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield zcomm.Topology(world_size=4, local_size=2)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("async_op", [False, True])
def test_counted_collectives_keep_everything_on_cuda(fake_world, async_op):
    zcomm.reset_comm_stats()
    with FakeTensorMode(), _DeviceAudit() as audit:
        shard, full = torch.empty(8, device="cuda"), torch.empty(4 * 8, device="cuda")
        works = [
            zcomm.all_gather_into_tensor(full, shard, async_op=async_op, topology=fake_world),
            zcomm.reduce_scatter_tensor(shard, full, async_op=async_op, topology=fake_world),
        ]
        for work in works:
            if async_op:
                work.wait()
    assert audit.calls > 0 and audit.off_device == []
    assert {name: stats.calls for name, stats in zcomm.comm_stats().items()} == {
        "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1,
    }


def test_hpz_blocks_and_node_groups_on_the_fake_backend(fake_world):
    from zcomm._groups import node_groups

    block = zcomm.consecutive_group(None, 2)
    assert dist.get_process_group_ranks(block) == [0, 1]
    assert zcomm.consecutive_group(None, 2) is block
    hops = {kind: node_groups(dist.group.WORLD, fake_world, kind) for kind in ("gather", "reduce")}
    for kind_hops in hops.values():
        assert dist.get_process_group_ranks(kind_hops.intra) == [0, 1]
        assert dist.get_process_group_ranks(kind_hops.inter) == [1, 3]
    # gathers and reductions never share a group (see [Note: kinds])
    assert hops["gather"].intra is not hops["reduce"].intra and hops["gather"].inter is not hops["reduce"].inter
    assert node_groups(dist.group.WORLD, fake_world, "reduce") == hops["reduce"]
    with FakeTensorMode(), _DeviceAudit() as audit:
        secondary, full = torch.empty(8, device="cuda"), torch.empty(2 * 8, device="cuda")
        zcomm.all_gather_into_tensor(full, secondary, group=block, topology=zcomm.Topology(world_size=2, local_size=2))
    assert audit.calls > 0 and audit.off_device == []
