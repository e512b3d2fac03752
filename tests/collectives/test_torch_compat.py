"""What ``zcomm._torch_compat`` relies on in torch, pinned (its private uses included).

[Note: creating zcomm's groups] in :mod:`zcomm._torch_compat` explains why a group created by
its members only goes through torch's internal ``_new_process_group_helper``. If a torch
upgrade changes what that relies on, these tests say so before a multi-rank run hangs.
"""

from __future__ import annotations

import inspect
import time

import pytest
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


class _FakeWorld:
    """A default group bound to ``cuda:0`` whose NCCL backend has the given construction counter."""

    bound_device_id = torch.device("cuda", 0)

    def __init__(self, uid: int):
        self._backend = type("FakeNCCL", (), {"uid": uid})()

    def _get_backend(self, device):
        assert device == self.bound_device_id
        return self._backend


def test_torch_release_parsing():
    assert torch_compat.release_of("2.11.0+cu130") == (2, 11)
    assert torch_compat.release_of("2.13.0a0+git1234") == (2, 13)
    assert torch_compat.release_of("3.0.0rc1") == (3, 0)


def test_a_reinitialised_bound_world_is_refused_with_the_reason(monkeypatch):
    for uid, refused in ((0, False), (1, True), (3, True)):
        world = _FakeWorld(uid)
        monkeypatch.setattr(c10d, "_get_default_group", lambda world=world: world)
        reason = torch_compat.split_crash_reason(world, "2.11.0+cu130")
        assert (reason is not None) == refused, (uid, reason)
        if refused:
            assert f"uid {uid}" in reason and "torch 2.11.0+cu130" in reason and "segmentation fault" in reason
            assert "destroyed" in reason and "device_id" in reason
        # a subgroup records its ranks: splitting it is safe whatever the world's history
        assert torch_compat.split_crash_reason(_FakeWorld(uid), "2.11.0+cu130") is None


def test_the_guard_follows_the_release_that_fixes_split(monkeypatch):
    world = _FakeWorld(2)
    monkeypatch.setattr(c10d, "_get_default_group", lambda: world)
    assert torch_compat.SPLIT_AFTER_REINIT_FIXED_IN is None  # no release known to carry the fix
    assert torch_compat.split_crash_reason(world, "2.13.0") is not None
    assert torch_compat.split_crash_reason(world, "2.9.1+cu128") is not None
    assert torch_compat.split_crash_reason(world, "2.8.0") is None  # split_group computed ranks in Python then
    monkeypatch.setattr(torch_compat, "SPLIT_AFTER_REINIT_FIXED_IN", (2, 14))
    assert torch_compat.split_crash_reason(world, "2.13.0+cu130") is not None
    assert torch_compat.split_crash_reason(world, "2.14.0+cu130") is None
    assert torch_compat.split_crash_reason(world, "2.15.1") is None


def test_split_subgroups_raises_before_entering_split_group(monkeypatch):
    world = _FakeWorld(1)
    monkeypatch.setattr(c10d, "_get_default_group", lambda: world)
    monkeypatch.setattr(torch_compat, "group_timeout", lambda group: None)

    def crash(**kwargs):
        raise AssertionError("split_group was entered")

    monkeypatch.setattr(dist, "split_group", crash)
    with pytest.raises(RuntimeError, match="segmentation fault"):
        torch_compat.split_subgroups(world, [[0]], desc="zcomm test")


def test_an_unbound_gloo_world_is_never_refused(gloo_world):
    assert gloo_world.bound_device_id is None
    assert torch_compat.split_crash_reason(gloo_world) is None


def test_tensor_use_count_counts_the_references_a_gloo_work_holds(gloo_world):
    """What [Note: hop release] relies on: a fresh tensor's count is 1, a view or a gloo Work holding it
    raises it, and it falls back once the Work is gone (gloo's thread has dropped its reference)."""
    send, received = torch.ones(8), torch.empty(8)
    assert torch_compat.tensor_use_count(send) == 1
    view = send.view(2, 4)
    assert torch_compat.tensor_use_count(send) == 2
    del view
    work = torch_compat.all_gather_single(received, send, async_op=True)
    assert torch_compat.tensor_use_count(send) > 1 and torch_compat.tensor_use_count(received) > 1
    work.wait()
    del work
    for _ in range(10_000):
        if torch_compat.tensor_use_count(send) == torch_compat.tensor_use_count(received) == 1:
            break
        time.sleep(0.001)
    assert torch_compat.tensor_use_count(send) == torch_compat.tensor_use_count(received) == 1


def test_fake_tensors_are_the_one_subclass_taken_as_plain():
    """[Note: plain tensors] in ``zcomm.quant._plain``: a tensor made under ``FakeTensorMode`` is
    of the class zcomm names, and a wrapper subclass is not taken as plain."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from zcomm.quant._plain import PLAIN_TENSORS

    with FakeTensorMode():
        fake = torch.empty(4)
    assert type(fake) in PLAIN_TENSORS and type(torch.empty(4)) in PLAIN_TENSORS
    assert torch.nn.Parameter not in PLAIN_TENSORS  # a Parameter goes through the full checks, as before
