"""Flat, padded layout of a group of parameters of arbitrary shapes.

A unit's parameters are laid end to end in one contiguous buffer, and the total is padded
up to a multiple of ``world_size`` so that the buffer splits into ``world_size`` equal
shards. Stage 0 keeps the whole buffer on every rank (one shard, ``world_size == 1``) but
all-reduces it in ``slices`` equal slices, one per rank (the reduce-scatter inside
``zcomm.all_reduce_q4``), so there the total is padded to a multiple of ``slices``. Padding
is zero in every buffer that follows this layout, so it never contributes to norms,
reductions or optimizer updates.

[Note: parameter-aligned blocks] With ``align = A > 1`` every parameter starts at a multiple
of ``A`` and the total is padded to a multiple of ``slices * A`` (``slices`` is
``world_size`` outside stage 0), so every shard and every slice starts at a multiple of
``A`` too. zcomm's quantized collectives cut each payload into groups of ``G`` elements
starting at the payload's first element (``all_gather_q8``: this rank's shard;
``reduce_scatter_q4``: each pipeline stage's part of this rank's slice of a bucket, and a
bucket's slice is its units' shards end to end; stage 0's ``all_reduce_q4``: in both of its
collectives, each rank's equal slice of a bucket's units laid end to end). When ``G``
divides ``A`` every group boundary the collectives draw falls on a multiple of ``A``, hence
no group holds elements of two parameters: a LayerNorm weight near 1.0 never shares a scale
with Linear weights near 0.02 (or their gradients), which would make the small ones' scale
up to 50x too coarse.
One exception remains: ``reduce_scatter_q4`` cuts a slice of ``m`` elements into ``k``
stage parts of ``ceil(m / k)``, which are whole groups only when ``G * k`` divides ``m``;
``k > 1`` only for buckets of more than 8 MiB (``zcomm.reduce_scatter_q4``'s default), and
then each of the ``k - 1`` inner stage boundaries can make one mixed group per hop row.
The cost is fewer than ``A`` zeros per parameter plus fewer than ``slices * A`` per
unit, sent and stored like any other element. That is small for a unit of large parameters
but not for a unit of one LayerNorm (2 x 128 elements would become ``slices * A``), so
``aligned_layout`` aligns a unit only when it costs at most ``ALIGN_BUDGET`` of the packed
size and packs it otherwise; whether the unit is aligned is ``layout.align > 1``.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


class Slot(NamedTuple):
    """Where one parameter lives in the flat buffer."""

    offset: int
    numel: int
    shape: torch.Size


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# Largest share of a unit's packed elements that aligning it may add (see [Note: parameter-aligned blocks]).
ALIGN_BUDGET = 1 / 32


class FlatLayout:
    def __init__(self, shapes: Sequence[torch.Size], *, world_size: int, align: int = 1,
                 slices: int | None = None) -> None:
        """``align``: each parameter's offset and each shard's size are multiples of it
        (see [Note: parameter-aligned blocks]); 1 packs the parameters without gaps.
        ``slices`` (default ``world_size``, a multiple of it): the total is padded to split
        into that many equal slices of whole ``align`` blocks (stage 0: the ranks' slices of
        the all-reduce, with one shard)."""
        slices = world_size if slices is None else slices
        assert world_size >= 1, world_size
        assert align >= 1, align
        assert slices % world_size == 0, (slices, world_size)
        slots, offset = [], 0
        for shape in shapes:
            shape = torch.Size(shape)
            offset = _round_up(offset, align)
            slots.append(Slot(offset, shape.numel(), shape))
            offset += shape.numel()
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.world_size = world_size
        self.align = align
        self.slices = slices
        self.numel = _round_up(max(offset, 1), slices * align)
        self.shard_numel = self.numel // world_size

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like the parameters (they share its storage)."""
        assert flat.numel() == self.numel, (flat.numel(), self.numel)
        return [flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots]

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def flatten(self, tensors: Sequence[torch.Tensor], *, dtype: torch.dtype) -> torch.Tensor:
        """A new zero-padded flat buffer holding ``tensors`` (shaped like the slots), on their device."""
        assert tensors, "nothing to flatten: the buffer's device comes from its tensors"
        flat = torch.zeros(self.numel, dtype=dtype, device=tensors[0].device)
        for view, tensor in zip(self.views(flat), tensors, strict=True):
            view.copy_(tensor)
        return flat


def aligned_layout(shapes: Sequence[torch.Size], *, world_size: int, align: int,
                   slices: int | None = None) -> FlatLayout:
    """The layout aligned to ``align`` if that adds at most ``ALIGN_BUDGET`` of the packed
    elements, else the packed one."""
    packed = FlatLayout(shapes, world_size=world_size, slices=slices)
    if align == 1:
        return packed
    aligned = FlatLayout(shapes, world_size=world_size, align=align, slices=slices)
    return aligned if aligned.numel - packed.numel <= packed.numel * ALIGN_BUDGET else packed
