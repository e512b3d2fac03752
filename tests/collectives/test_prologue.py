"""The collectives' argument checks and ``group_size="tensor"``, on a 1-rank world in this process.

Every check (``zcomm._prologue``, ``zcomm.quant.QuantSpec``, the collectives' own ``op`` and
``pipeline_stages``) runs before any communication, so one rank sees them all; the
multi-rank results are in ``test_collectives.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zcomm

ag, rs, rsc = zcomm.all_gather_q8, zcomm.reduce_scatter_q4, zcomm.reduce_scatter_q4_coalesced
X = torch.randn(4)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: rs(torch.empty(4), torch.randn(8)[::2]), ValueError, "input must be contiguous"),
        (lambda: rs(torch.empty(5), X), ValueError, r"input.numel\(\) must be world size \(1\)"),
        (lambda: ag(torch.empty(5), X), ValueError, r"output.numel\(\) must be world size \(1\)"),
        (lambda: rs(torch.empty(4, dtype=torch.half), X), ValueError, "dtypes differ"),
        (lambda: ag(torch.empty(4, dtype=torch.float64), X.double()), ValueError, "float64"),
        (lambda: rs(torch.empty(4), X, dist.ReduceOp.MAX), ValueError, "op must be ReduceOp.SUM, ReduceOp.AVG or"),
        (lambda: rs(torch.empty(4), X, dist._make_nccl_premul_sum(-0.5)), ValueError, "positive finite"),
        (lambda: rs(torch.empty(4), X, dist._make_nccl_premul_sum(torch.tensor(0.5))), ValueError, "Python float"),
        (lambda: rs(torch.empty(4), X, pipeline_stages=0), ValueError, "pipeline_stages"),
        (lambda: ag(torch.empty(4), X, pipeline_stages=True), ValueError, "pipeline_stages"),
        (lambda: rs(torch.empty(4), X, group_size=7), ValueError, "group_size must be even"),
        (lambda: ag(torch.empty(4), X, group_size=1), ValueError, "group_size must be >= 2"),
        (lambda: ag(torch.empty(4), X, group_size="blocked"), TypeError, '"tensor" or None'),
        (lambda: rs(torch.empty(4), X, group_size=2.0), TypeError, '"tensor" or None'),
        (lambda: rs(torch.empty(4), X, topology=zcomm.Topology(world_size=2, local_size=1)), ValueError,
         "topology is for 2 ranks but the group has 1"),
        (lambda: ag(torch.empty(4), X, topology=(1, 1)), TypeError, "topology must be a zcomm.Topology"),
        (lambda: rsc(torch.empty(4), [X]), TypeError, "outputs must be a list or tuple of tensors"),
        (lambda: rsc([], []), ValueError, "non-empty and of one length"),
        (lambda: rsc([torch.empty(4)], [X, X]), ValueError, "non-empty and of one length"),
        (lambda: rsc([torch.empty(4), torch.empty(3)], [X, X]), ValueError, r"pair 1: input.numel\(\) must be"),
        (lambda: rsc([torch.empty(4), torch.empty(4).half()], [X, X.half()]), ValueError, "pair 1 is torch.float16"),
        (lambda: rsc([torch.empty(4)], [X], dist.ReduceOp.MAX), ValueError, "op must be ReduceOp.SUM, ReduceOp.AVG or"),
        (lambda: rsc([torch.empty(4)], [X], pipeline_stages=-1), ValueError, "pipeline_stages"),
        (lambda: zcomm.all_gather_into_tensor(torch.empty(5), X), ValueError, "numel"),
        (lambda: zcomm.reduce_scatter_tensor(torch.empty(4), [X]), TypeError, "input must be a torch.Tensor"),
    ],
)
def test_bad_arguments_fail_before_any_communication(gloo_world, call, error, match):
    zcomm.reset_comm_stats()
    with pytest.raises(error, match=match):
        call()
    assert zcomm.comm_stats() == {}, "a rejected call must not be counted"


def test_the_collectives_need_an_initialized_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ag(torch.empty(4), X)


def _one_group_round_trip(x: torch.Tensor, bits: int) -> torch.Tensor:
    """``x`` quantized with a single scale and back (the reference backend)."""
    group_size = max(2, x.numel() + x.numel() % 2)
    payload = zcomm.quant.quantize(x, bits, group_size, backend="reference")
    return zcomm.quant.dequantize(payload, x.numel(), bits, group_size, x.dtype, backend="reference").view(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 1001, 5000])
def test_group_size_tensor_is_one_scale_per_payload(gloo_world, one_rank, dtype, numel):
    """On one rank each collective is one quantization round trip: with ``"tensor"``, all_gather_q8's
    payload is the whole input and reduce_scatter_q4's payload rows are its pipeline parts, each with
    one scale (5000 elements is beyond both default group sizes, so the default would differ)."""
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 10).to(dtype)
    gathered = torch.empty_like(x)
    ag(gathered, x, group_size="tensor", topology=one_rank)
    assert torch.equal(gathered, _one_group_round_trip(x, 8))
    stages = 3
    part = -(-numel // stages)
    reduced = torch.empty_like(x)
    rs(reduced, x, group_size="tensor", pipeline_stages=stages, topology=one_rank)
    assert torch.equal(reduced, torch.cat([_one_group_round_trip(p, 4) for p in x.split(part)]))


def test_one_rank_has_nothing_to_pipeline(gloo_world, one_rank):
    """No hop to overlap: any pipeline_stages gives the one round trip of the input."""
    x = torch.randn(1001, generator=torch.Generator().manual_seed(3))
    gathered = torch.empty_like(x)
    ag(gathered, x, group_size=8, pipeline_stages=3, topology=one_rank)
    expected = zcomm.quant.dequantize(zcomm.quant.quantize(x, 8, 8), x.numel(), 8, 8, x.dtype)
    assert torch.equal(gathered, expected)
