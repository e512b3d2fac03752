"""zcomm.fsdp: ZeRO++ collectives inside PyTorch FSDP2, on gloo ranks laid out as 2x2 and 3x2 nodes.

The spawned checks live in ``fsdp_cases.py`` (each against plain FSDP2, ``full_tensor()`` or
an unsharded model, with bounds derived there); here also what one process can check: the
errors, the torch contract zcomm's adapter relies on (private module included) and the
``Work`` wrapper.
"""

from __future__ import annotations

import inspect
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_cases
import zcomm
import zcomm.fsdp
from spawn_harness import run_distributed
from zcomm import _fsdp_compat

ALL_CHECKS = ("exact", "gradients", "weights", "async_unshard", "tracking", "uint8_fallback", "hsdp")


@pytest.mark.parametrize(
    ("world", "local_size", "checks"),
    [
        (4, 2, ALL_CHECKS),  # 2 nodes x 2 ranks
        (6, 2, ("exact", "gradients", "weights", "tracking")),  # 3 nodes x 2 ranks
    ],
    ids=["2x2", "3x2"],
)
def test_fsdp2_with_zcomm_collectives(world, local_size, checks):
    results = run_distributed(fsdp_cases.rank_main, world, args=(local_size, checks), timeout=900, pg_timeout=300)
    assert results == [list(checks)] * world


def test_torch_contract_the_adapter_relies_on():
    """The private FSDP2 comm API as zcomm.fsdp uses it ([its module docstring] lists what)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    assert _fsdp_compat.torch_problem() is None
    assert _fsdp_compat.AllGather.__module__ == "torch.distributed.fsdp._fully_shard._fsdp_api"
    assert list(inspect.signature(_fsdp_compat.AllGather.__call__).parameters) == [
        "self", "output_tensor", "input_tensor", "group", "async_op",
    ]
    assert list(inspect.signature(_fsdp_compat.ReduceScatter.__call__).parameters) == [
        "self", "output_tensor", "input_tensor", "group", "op", "async_op",
    ]
    assert "allocate" in _fsdp_compat.AllGather.__abstractmethods__
    # FSDP2 waits on the all-gather's result only when it is a Work
    source = inspect.getsource(_fsdp_collectives.foreach_all_gather_copy_out)
    assert "isinstance(all_gather_work, dist.distributed_c10d.Work)" in source
    assert issubclass(_fsdp_compat.HandleWork, dist.distributed_c10d.Work)


@pytest.mark.parametrize(
    ("version", "import_error", "match"),
    [
        ("2.10.1+cu128", None, r"torch 2.10.1\+cu128 is not supported by zcomm.fsdp; supported: torch >= 2.11"),
        ("2.12.0", "cannot import name 'AllGather'", "no FSDP2 custom-collective API.*AllGather"),
    ],
)
def test_unsupported_torch_is_named(monkeypatch, gloo_world, version, import_error, match):
    problem = _fsdp_compat.torch_problem(version, import_error)
    assert problem is not None
    monkeypatch.setattr(zcomm.fsdp, "torch_problem", lambda: problem)
    with pytest.raises(ValueError, match=match):
        zcomm.fsdp.enable_zeropp(nn.Linear(2, 2))


def test_supported_torch_versions_pass():
    for version in ("2.11.0+cu130", "2.13.0", "3.0.0"):
        assert _fsdp_compat.torch_problem(version, "") is None


def test_bad_arguments(gloo_world):
    with pytest.raises(ValueError, match="holds no FSDPModule: apply fully_shard before enable_zeropp"):
        zcomm.fsdp.enable_zeropp(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        zcomm.fsdp.enable_zeropp(object())
    with pytest.raises(TypeError, match="quantized_weights must be a bool"):
        zcomm.fsdp.enable_zeropp(nn.Linear(2, 2), quantized_weights=1)


def test_handle_work_waits_for_the_chain_once():
    """The Work wraps a zcomm Handle: wait() blocks until the chain's tail ran, exactly once."""
    gate, calls = threading.Event(), []

    def finish():
        gate.wait()
        calls.append(1)

    work = _fsdp_compat.as_work(zcomm.Handle(finish=finish, ready=gate.is_set))
    assert isinstance(work, dist.Work) and not work.is_completed()
    threading.Timer(0.2, gate.set).start()
    assert work.wait() is True
    assert calls == [1] and work.is_completed()
    work.wait()
    assert calls == [1]
    plain = object()
    assert _fsdp_compat.as_work(None) is None and _fsdp_compat.as_work(plain) is plain


def test_premul_sum_is_the_fp32_division_by_its_inverse(gloo_world):
    """reduce_scatter_q4 with PREMUL_SUM(1/3) on one rank: ``fl32(S / fl32(3))``, AVG's bits over 3
    ([Note: PREMUL_SUM as a division]); and PREMUL_SUM(0.3) matches ``S * 0.3`` within 2**-22."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    for factor in (1 / 3, 0.3):
        out = torch.empty(64)
        zcomm.reduce_scatter_q4(out, x, dist._make_nccl_premul_sum(factor), group_size=2)
        summed = torch.empty(64)
        zcomm.reduce_scatter_q4(summed, x, dist.ReduceOp.SUM, group_size=2)
        if factor == 1 / 3:
            assert torch.equal(out, summed / torch.tensor(3.0))
        else:
            torch.testing.assert_close(out, summed * factor, rtol=2.0**-22, atol=0)
