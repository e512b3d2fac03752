"""Parameter-aligned quantization blocks (see [Note: parameter-aligned blocks]).

Single process, no process group: the flat layout is checked against the group frames the
quantized collectives use (groups of ``G`` from the start of each shard, shards end to end
in a bucket's slice), and the real INT4/INT8 quantizer is run on that frame with an
analytic per-parameter error bound.
"""

from __future__ import annotations

import math

import pytest
import torch

import zcomm.quant as quant
from zero_runtime import ZeroConfig
from zero_runtime._flat_buffer import ALIGN_BUDGET, FlatLayout, aligned_layout

# A transformer block's shapes in model order: a LayerNorm, Linear weights and biases of
# sizes that are not multiples of any group size.
SHAPES = [(128,), (128,), (384, 128), (384,), (128, 128), (128,), (100, 7), (3,), (512, 128), (1,)]


def _owners(layout: FlatLayout) -> torch.Tensor:
    """Per flat element, the index of the parameter it holds, or -1 for padding."""
    owner = torch.full((layout.numel,), -1, dtype=torch.long)
    for index, slot in enumerate(layout.slots):
        owner[slot.offset : slot.offset + slot.numel] = index
    return owner


def _mixed_groups(layout: FlatLayout, group_size: int) -> int:
    """Groups, in every shard's frame, holding elements of more than one parameter."""
    owner = _owners(layout)
    mixed = 0
    for rank in range(layout.world_size):
        lo, hi = layout.shard_range(rank)
        for start in range(lo, hi, group_size):
            held = set(owner[start : min(start + group_size, hi)].tolist()) - {-1}
            mixed += len(held) > 1
    return mixed


@pytest.mark.parametrize("world", [1, 4, 8])
@pytest.mark.parametrize("group_sizes", [(512,), (2048, 512), (128,), (96, 64)])
def test_aligned_blocks_never_mix_parameters(world, group_sizes):
    align = math.lcm(*group_sizes)
    layout = FlatLayout(SHAPES, world_size=world, align=align)
    for group_size in group_sizes:
        assert _mixed_groups(layout, group_size) == 0, (world, group_size)
    assert all(slot.offset % align == 0 for slot in layout.slots)
    assert layout.shard_numel % align == 0
    # slots do not overlap and hold every element
    owner = _owners(layout)
    assert [(owner == i).sum().item() for i in range(len(SHAPES))] == [math.prod(s) for s in SHAPES]


def test_packed_layout_mixes_parameters():
    """The check above can fail: the packed layout (``align_quant_blocks=False``) does mix."""
    assert _mixed_groups(FlatLayout(SHAPES, world_size=4), 512) > 0


def test_alignment_costs_less_than_one_group_per_parameter_and_shard():
    packed = FlatLayout(SHAPES, world_size=4)
    aligned = FlatLayout(SHAPES, world_size=4, align=512)
    assert aligned.numel - packed.numel < 512 * (len(SHAPES) + 4)


def test_a_unit_is_aligned_only_when_it_is_cheap():
    """A unit of large parameters is aligned; a unit of one small LayerNorm would grow to
    ``world * A`` elements, so it stays packed (and says so through ``align``)."""
    big = [(1000, 128), (128,), (128,), (128, 1000)]
    layout = aligned_layout(big, world_size=4, align=512)
    assert layout.align == 512 and _mixed_groups(layout, 512) == 0
    assert layout.numel <= FlatLayout(big, world_size=4).numel * (1 + ALIGN_BUDGET)
    small = [(128,), (128,)]
    assert aligned_layout(small, world_size=4, align=512).align == 1
    assert aligned_layout(big, world_size=4, align=1).align == 1


def test_units_of_buckets_stay_aligned():
    """A bucket's slice is its units' shards end to end: every unit's shard is a multiple of
    the alignment, so the concatenation keeps every group inside one parameter."""
    units = [FlatLayout(SHAPES[:4], world_size=4, align=512), FlatLayout(SHAPES[4:], world_size=4, align=512)]
    assert all(u.shard_numel % 512 == 0 for u in units)


@pytest.mark.parametrize("bits, group_size", [(4, 512), (8, 2048)])
def test_quantized_shard_error_is_bounded_by_each_parameters_own_scale(bits, group_size):
    """The real quantizer on an aligned shard: every element is within half of the scale of
    its own parameter's absmax (absmax / qmax / 2), so a LayerNorm-like parameter near 1.0
    does not coarsen its 0.02-sized neighbours. The packed layout breaks that bound."""
    torch.manual_seed(0)
    magnitudes = [1.0, 0.01, 0.02, 0.5, 0.02, 3.0, 0.001, 1.0, 0.02, 10.0]
    params = [torch.randn(s) * m for s, m in zip(SHAPES, magnitudes, strict=True)]
    qmax = quant.QMAX[bits]

    def worst_excess(layout: FlatLayout) -> float:
        flat = layout.flatten(params, dtype=torch.float32)
        restored = torch.empty_like(flat)
        for rank in range(layout.world_size):
            lo, hi = layout.shard_range(rank)
            payload = quant.quantize(flat[lo:hi], bits, group_size, backend="reference")
            restored[lo:hi] = quant.dequantize(payload, hi - lo, bits, group_size, torch.float32, backend="reference")
        excess = 0.0
        for view, original in zip(layout.views(restored), params, strict=True):
            bound = original.abs().max().item() / qmax / 2 * (1 + 1e-5)
            excess = max(excess, ((view - original).abs().max().item() - bound))
        return excess

    assert worst_excess(FlatLayout(SHAPES, world_size=4, align=group_size)) <= 0
    assert worst_excess(FlatLayout(SHAPES, world_size=4)) > 0


def test_config_alignment_follows_the_quantized_collectives():
    assert ZeroConfig(stage=3).quant_block_align() == 1
    assert ZeroConfig(stage=3, quantized_gradients=True).quant_block_align() == quant.DEFAULT_GROUP_SIZE[4]
    both = ZeroConfig(stage=3, quantized_gradients=True, quantized_weights=True)
    assert both.quant_block_align() == math.lcm(quant.DEFAULT_GROUP_SIZE[4], quant.DEFAULT_GROUP_SIZE[8])
    assert ZeroConfig(stage=3, quantized_weights=True, quant_group_size=96).quant_block_align() == 96
    assert ZeroConfig(stage=3, quantized_gradients=True, quant_group_size="tensor").quant_block_align() == 1
    off = {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True, "zcomm_align_quant_blocks": False}}
    assert ZeroConfig.from_dict(off).quant_block_align() == 1
    with pytest.raises(TypeError, match="zcomm_align_quant_blocks"):
        ZeroConfig(stage=3, quantized_gradients=True, align_quant_blocks=1)
