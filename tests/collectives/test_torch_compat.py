"""What ``zcomm._torch_compat`` relies on in torch, pinned (its private uses included).

[Note: creating zcomm's groups] in :mod:`zcomm._torch_compat` explains why a group created by
its members only goes through torch's internal ``_new_process_group_helper``. If a torch
upgrade changes what that relies on, these tests say so before a multi-rank run hangs.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from zcomm import _torch_compat as torch_compat


def test_the_internals_zcomm_uses_have_the_expected_shape():
    helper = inspect.signature(c10d._new_process_group_helper).parameters
    assert list(helper)[:6] == ["group_size", "group_rank", "global_ranks_in_group", "backend", "store", "group_name"]
    assert {"timeout", "group_desc"} <= set(helper)
    assert callable(c10d._get_default_store)
    assert isinstance(c10d._world.pg_group_ranks, dict)
    split = inspect.signature(dist.split_group).parameters
    assert {"parent_pg", "split_ranks", "timeout", "group_desc"} <= set(split)


def test_new_named_group_and_group_timeout_on_one_rank(gloo_world, world_timeout):
    assert torch_compat.group_timeout(gloo_world) == world_timeout
    assert not torch_compat.creates_by_split(gloo_world)
    group = torch_compat.new_named_group("zcomm-test/solo", [0], like=gloo_world, desc="zcomm test")
    assert (dist.get_rank(group), dist.get_world_size(group), dist.get_process_group_ranks(group)) == (0, 1, [0])
    assert torch_compat.group_timeout(group) == world_timeout
    assert dist.get_backend(group) == dist.get_backend(gloo_world)
    value = torch.tensor([3.0])
    dist.all_reduce(value, group=group)
    assert value.item() == 3.0
