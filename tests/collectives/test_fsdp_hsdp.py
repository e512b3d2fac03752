"""zcomm.fsdp's HSDP: sharded inside each node, replicated across nodes by the quantized all-reduce.

The spawned checks live in ``fsdp_hsdp_cases.py`` (against FSDP2's own HSDP on a 2-D mesh, with
bounds derived there); here what one process can check: the argument errors raised before
any communication.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_hsdp_cases
import zcomm
import zcomm.fsdp
from spawn_harness import run_distributed

CHECKS = ("exact", "gradients", "division", "stats", "tracking", "error_feedback", "fresh_mesh", "errors")


def test_hsdp_with_zcomm_against_plain_hsdp():
    """2 nodes x 2 ranks: every check of fsdp_hsdp_cases on every rank."""
    results = run_distributed(fsdp_hsdp_cases.rank_main, 4, args=(2, CHECKS), timeout=900, pg_timeout=300)
    assert results == [list(CHECKS)] * 4


def test_hsdp_accumulation_without_the_all_reduce_against_plain_hsdp():
    """2 nodes x 2 ranks: set_requires_all_reduce(False) on the micro-batches but the last."""
    results = run_distributed(fsdp_hsdp_cases.rank_main, 4, args=(2, ("accumulation",)), timeout=900, pg_timeout=300)
    assert results == [["accumulation"]] * 4


def _one_rank_unit() -> nn.Module:
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model


def test_bad_replicate_arguments(gloo_world):
    model = _one_rank_unit()
    for option in ({"replicate_topology": zcomm.Topology(world_size=1, local_size=1)},
                   {"quantized_all_reduce": False}, {"replicate_gather_bits": 4}, {"error_feedback": True}):  # fmt: skip
        with pytest.raises(ValueError, match="applies to the replicate all-reduce: it needs replicate_group"):
            zcomm.fsdp.enable_zeropp(model, **option)
    with pytest.raises(TypeError, match="replicate_group must be a torch.distributed.ProcessGroup, got str"):
        zcomm.fsdp.enable_zeropp(model, replicate_group="replicate")
    with pytest.raises(TypeError, match="quantized_all_reduce must be a bool"):
        zcomm.fsdp.enable_zeropp(model, replicate_group=dist.group.WORLD, quantized_all_reduce=1)
    for bits in (6, True, "4"):
        with pytest.raises(ValueError, match="gather_bits must be 4, 8 or None"):
            zcomm.fsdp.enable_zeropp(model, replicate_group=dist.group.WORLD, replicate_gather_bits=bits)
    with pytest.raises(ValueError, match="replicate_gather_bits is the quantized all-reduce's"):
        zcomm.fsdp.enable_zeropp(model, replicate_group=dist.group.WORLD, quantized_all_reduce=False,
                                 replicate_gather_bits=4)  # fmt: skip
    with pytest.raises(ValueError, match="error_feedback corrects the quantized all-reduce"):
        zcomm.fsdp.enable_zeropp(model, replicate_group=dist.group.WORLD, quantized_all_reduce=False,
                                 error_feedback=True)  # fmt: skip
    with pytest.raises(ValueError, match="error_feedback cannot be combined with hadamard_block"):
        zcomm.fsdp.enable_zeropp(model, replicate_group=dist.group.WORLD, error_feedback=True, hadamard_block=64,
                                 align_blocks=False)  # fmt: skip
    with pytest.raises(ValueError, match="replicate_topology is for 2 ranks but replicate_group has 1"):
        zcomm.fsdp.enable_zeropp(model, replicate_group=dist.group.WORLD,
                                 replicate_topology=zcomm.Topology(world_size=2, local_size=1))  # fmt: skip


def test_one_replica_is_a_plain_fsdp_step(gloo_world):
    """A replicate group of one rank (this one) passes the checks; its all-reduce leaves the gradients as they are."""
    grads = []
    for replicated in (False, True):
        torch.manual_seed(0)
        model = _one_rank_unit()
        if replicated:
            zcomm.fsdp.enable_zeropp(model, replicate_group=dist.group.WORLD, quantized_all_reduce=False)
            assert list(zcomm.fsdp.all_reduce_hooks(model)) == ["FSDPLinear"]  # the root by its class name
        zcomm.reset_comm_stats()
        model(torch.ones(3, 4)).sum().backward()
        grads.append(model.weight.grad.full_tensor())
    assert torch.equal(*grads)
    assert zcomm.comm_stats()["all_reduce"].calls == 1


def test_accumulation_keeps_the_partial_sum_until_the_all_reduce(gloo_world):
    """One replica: with set_requires_all_reduce(False) the hook keeps the sum and hands FSDP2
    zeros, the next call with it on gets the sum; a reduce output of another size is refused,
    and discard_partial drops the sum."""
    model = _one_rank_unit()
    zcomm.fsdp.enable_zeropp(model, replicate_group=dist.group.WORLD, quantized_all_reduce=False)
    hook = zcomm.fsdp.all_reduce_hooks(model)["FSDPLinear"]
    model.set_requires_all_reduce(False)
    first, second = torch.full((6,), 1.5), torch.full((6,), 2.0)
    hook(first)
    hook(second)
    assert not first.any() and not second.any()
    assert torch.equal(hook.partial, torch.full((6,), 3.5))
    with pytest.raises(RuntimeError, match="accumulated reduce outputs of 6 torch.float32 elements, this micro-batch"):
        hook(torch.ones(5))
    model.set_requires_all_reduce(True)
    last = torch.full((6,), 0.25)
    hook(last)
    assert torch.equal(last, torch.full((6,), 3.75)) and hook.partial is None
    model.set_requires_all_reduce(False)
    hook(torch.ones(6))
    hook.discard_partial()
    model.set_requires_all_reduce(True)
    last = torch.full((6,), 0.25)
    hook(last)
    assert torch.equal(last, torch.full((6,), 0.25))
