"""TiledLinear against nn.Linear (the oracle): bit-identical where the sums are the same, bounded
by an fp64 reference where tiling splits them; under stage 3 each tile is its own unit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero_runtime import TiledLinear


def test_one_tile_is_bit_identical():
    torch.manual_seed(0)
    linear = nn.Linear(24, 35)
    x = torch.randn(5, 24)
    assert torch.equal(TiledLinear.from_linear(linear)(x), linear(x))


@pytest.mark.parametrize("in_splits, out_splits", [(1, 3), (1, 7), (2, 1), (4, 3), (24, 2)])
def test_tiles_within_fp32_round_off_of_fp64(in_splits, out_splits):
    # MKL's GEMM blocks differently for each shape, so even output splits (the same dot
    # products) are not bit-identical to nn.Linear; both are within round-off of fp64.
    torch.manual_seed(0)
    linear = nn.Linear(24, 35)
    tiled = TiledLinear.from_linear(linear, in_splits=in_splits, out_splits=out_splits)
    x = torch.randn(5, 24)
    exact = x.double() @ linear.weight.double().T + linear.bias.double()
    # Any fp32 summation order of 25 terms is within 25 * 2^-24 * sum|terms| of the exact sum.
    bound = 25 * 2.0**-24 * ((x.abs().double() @ linear.weight.abs().double().T) + linear.bias.abs().double())
    y = tiled(x)
    assert ((y.double() - exact).abs() <= bound).all()
    assert ((linear(x).double() - exact).abs() <= bound).all()
    y.sum().backward()  # d/dW of sum(y) is exact: every row gets x summed over the batch
    weight = torch.cat([torch.cat([t.weight.grad for t in row], dim=1) for row in tiled.tiles], dim=0)
    torch.testing.assert_close(weight, x.sum(0).expand(35, 24), rtol=1e-6, atol=1e-6)


def test_default_init_and_errors():
    tiled = TiledLinear(16, 8, in_splits=2, out_splits=2)
    weights = [t.weight for row in tiled.tiles for t in row]
    assert all(w.abs().max() <= 16**-0.5 for w in weights)  # nn.Linear's bound for fan-in 16
    assert sum(t.bias is not None for row in tiled.tiles for t in row) == 2
    with pytest.raises(ValueError, match="in_splits"):
        TiledLinear(4, 4, in_splits=5)
    with pytest.raises(ValueError, match="out_splits"):
        TiledLinear(4, 4, out_splits=0)


def _model(tiled: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    if tiled:
        model[0] = TiledLinear.from_linear(model[0], out_splits=4)
    return model


def test_stage3_gathers_tiles_as_separate_units_and_trains_like_linear(tmp_path):
    import torch.distributed as dist

    import zero_runtime

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        "zcomm_stage3_fuse_numel": 0}}
        losses = {}
        for tiled in (False, True):
            model, opt = zero_runtime.initialize(_model(tiled), lambda p: torch.optim.AdamW(p, lr=1e-2), config)
            if tiled:
                tile_units = {u.index for u in opt.units for n in u.names if n.startswith("0.tiles.")}
                assert len(tile_units) == 4  # one unit per tile, gathered separately
            gen = torch.Generator().manual_seed(1)
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)  # memorised
            losses[tiled] = []
            for _ in range(5):
                loss = nn.functional.mse_loss(model(x), y)
                opt.backward(loss)
                opt.step()
                losses[tiled].append(loss.item())
        # Equal up to fp32 round-off (GEMM blocking differs per shape; see above).
        torch.testing.assert_close(losses[True], losses[False], rtol=1e-5, atol=0)
        assert losses[True][-1] < losses[True][0]
    finally:
        dist.destroy_process_group()
