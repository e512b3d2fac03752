"""``TiledLinear``: memory-centric tiling (ZeRO-Infinity section 5.1.3), a drop-in for ``nn.Linear``.

The weight is split into ``out_splits x in_splits`` tiles, each an ``nn.Linear`` submodule
of its own. Stage 3 partitions and gathers parameters per module (one unit per module once
the layer is larger than ``zcomm_stage3_fuse_numel``; see [Note: fused units] in
``_partition``), so the tiles are gathered, used and freed one after another and one huge
layer never needs all of its weights resident: with ``stage3_max_live_parameters`` and
``stage3_max_reuse_distance`` small enough, at most a few tiles are live.

``y[..., rows_j] = sum_i tile[j][i](x[..., cols_i])``; the bias lives in the ``i = 0`` tile
of each output block. One tile is bit-identical to ``nn.Linear``; several are not, even
when only the output is split (the same dot products: the CPU GEMM blocks its sums
differently for each shape), and ``in_splits > 1`` sums the input dimension in
``in_splits`` partial sums: both stay within fp32 round-off of the fp64 result, as
``nn.Linear`` does (bounded in ``tests/runtime/test_tiled_linear.py``). The constructor
initialises the full weight as ``nn.Linear`` would, in one temporary tensor on the CPU.
"""

from __future__ import annotations

import torch
from torch import nn


def _split(size: int, parts: int, name: str) -> list[int]:
    if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= size:
        raise ValueError(f"{name} must be an integer in [1, {size}], got {parts!r}")
    base, extra = divmod(size, parts)
    return [base + (k < extra) for k in range(parts)]


class TiledLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, in_splits: int = 1,
                 out_splits: int = 1, device=None, dtype=None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.in_sizes = _split(in_features, in_splits, "in_splits")
        self.out_sizes = _split(out_features, out_splits, "out_splits")
        self.tiles = nn.ModuleList(
            nn.ModuleList(nn.Linear(i, o, bias=bias and k == 0, device=device, dtype=dtype)
                          for k, i in enumerate(self.in_sizes))
            for o in self.out_sizes)
        self._init_like_linear(bias)

    @torch.no_grad()
    def _init_like_linear(self, bias: bool) -> None:
        """Initialise the full weight as ``nn.Linear`` does (its fan-in is the full input)."""
        ref = nn.Linear(self.in_features, self.out_features, bias=bias)
        self.load_linear(ref)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, in_splits: int = 1, out_splits: int = 1) -> "TiledLinear":
        tiled = cls(linear.in_features, linear.out_features, linear.bias is not None, in_splits=in_splits,
                    out_splits=out_splits, device=linear.weight.device, dtype=linear.weight.dtype)
        tiled.load_linear(linear)
        return tiled

    @torch.no_grad()
    def load_linear(self, linear: nn.Linear) -> None:
        """Copy ``linear``'s weight (and bias) into the tiles."""
        rows = torch.split(linear.weight, self.out_sizes, dim=0)
        biases = torch.split(linear.bias, self.out_sizes) if linear.bias is not None else [None] * len(rows)
        for row_tiles, block, bias in zip(self.tiles, rows, biases, strict=True):
            for tile, part in zip(row_tiles, torch.split(block, self.in_sizes, dim=1), strict=True):
                tile.weight.copy_(part)
            if bias is not None:
                row_tiles[0].bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs = torch.split(x, self.in_sizes, dim=-1)
        outputs = []
        for row_tiles in self.tiles:
            y = row_tiles[0](inputs[0])
            for tile, part in zip(row_tiles[1:], inputs[1:], strict=True):
                y = y + tile(part)
            outputs.append(y)
        return torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"in_splits={len(self.in_sizes)}, out_splits={len(self.out_sizes)}")
