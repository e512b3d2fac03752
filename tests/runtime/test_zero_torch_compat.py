"""What ``zero_runtime._torch_compat`` relies on in torch, pinned: the fake process group of the dry run.

[Note: fake world] in :mod:`zero_runtime._torch_compat` explains why the dry run reaches torch's
``fake`` backend through ``torch.testing._internal``. If a torch upgrade moves or changes it,
these tests say so before ``python -m zero_runtime.estimate --dry-run`` breaks.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

import zcomm
from zero_runtime import _torch_compat


@pytest.fixture
def fake_world():
    _torch_compat.init_fake_world(5, 4096)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_private_module_has_the_store():
    module = importlib.import_module("torch.testing._internal.distributed.fake_pg")
    assert issubclass(module.FakeStore, dist.Store)
    assert _torch_compat.FAKE_BACKEND == dist.Backend.FAKE == "fake"


def test_a_fake_world_is_a_real_world_of_one_rank(fake_world):
    assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (5, 4096, "fake")
    assert set(dist.get_backend_config().replace(":", ",").split(",")) >= {"cpu", "fake"}
    block = zcomm.consecutive_group(None, 16)  # zcomm creates its subgroups by their members
    assert dist.get_process_group_ranks(block) == list(range(16))
    assert (dist.get_rank(block), dist.get_world_size(block), dist.get_backend(block)) == (5, 16, "fake")
    peers = zcomm.block_peers_group(None, 16)  # rank 5's position in every block of 16
    assert dist.get_process_group_ranks(peers) == list(range(5, 4096, 16))
    assert (dist.get_rank(peers), dist.get_world_size(peers)) == (0, 256)
    for size in (0, 3, True):
        with pytest.raises(ValueError, match="positive divisor of the group size 4096"):
            zcomm.block_peers_group(None, size)


def test_collectives_complete_as_if_every_rank_held_this_ranks_input(fake_world):
    """The dry run's counts come from zcomm's byte model; the fake backend has to accept the calls
    (sync and async) and complete them at once. It fills outputs as if every rank held this
    rank's input, so values stay finite (fp16 loss scaling then skips no step): pinned here."""
    block = zcomm.consecutive_group(None, 8)
    shard, full = torch.arange(3.0), torch.full((24,), 7.0)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    all_gather(full, shard, group=block)
    assert torch.equal(full, shard.repeat(8))
    out = torch.full((3,), -1.0)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    reduce_scatter(out, torch.arange(24.0), group=block, async_op=True).wait()
    assert torch.isfinite(out).all() and not torch.equal(out, torch.full((3,), -1.0))
    received = torch.zeros(16, dtype=torch.uint8)
    sent = torch.arange(16, dtype=torch.uint8)
    dist.all_to_all_single(received, sent, group=block, async_op=True).wait()
    assert torch.equal(received, sent)
    norms = torch.tensor([2.0])
    dist.all_reduce(norms)
    assert norms.item() == 2.0


def test_init_fake_world_refuses_a_second_world_and_bad_ranks(fake_world):
    with pytest.raises(RuntimeError, match="already initialised"):
        _torch_compat.init_fake_world(0, 2)


@pytest.mark.parametrize("rank, world_size", [(4, 4), (-1, 4), (0, 0), (True, 2)])
def test_init_fake_world_checks_its_arguments(rank, world_size):
    with pytest.raises(ValueError):
        _torch_compat.init_fake_world(rank, world_size)
    assert not dist.is_initialized()
