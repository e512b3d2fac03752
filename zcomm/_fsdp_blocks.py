"""Parameter-aligned quantization blocks for FSDP2's flat buffers (used by :mod:`zcomm.fsdp`).

FSDP2 lays each unit's parameters end to end in its flat buffers: a rank's all-gather input
is its padded shard of every parameter in the unit's order, and row ``r`` of the
reduce-scatter input (``world`` rows) is rank ``r``'s padded shard of every gradient, in the
same order. zcomm's quantized collectives cut each payload into groups of ``G`` elements from
its first element, so a group can hold the tail of one parameter and the head of the next: a
LayerNorm weight near 1.0 then shares an INT8 or INT4 scale with Linear weights near 0.02
(or their gradients), and the small ones lose most of their precision.

[Note: aligned staging] FSDP2's layout is not ours to change, so the adapter stages each
quantized collective through a padded copy of it: every parameter's piece of a row starts at
a multiple of ``A`` (the least common multiple of the group sizes in use) and the row is
padded with zeros to a multiple of ``A`` (times the reduce-scatter's pipeline stage count,
so that each stage's part starts at a multiple of ``A`` too). Every group boundary the
collectives draw then falls on a multiple of ``G``, which divides ``A``, hence no group
holds elements of two parameters, and the zeros change no group's absmax. This is
zero_runtime's layout rule ([Note: parameter-aligned blocks] in ``zero_runtime._flat_buffer``)
applied to a copy: a unit is aligned only when that adds at most :data:`ALIGN_BUDGET` of its
packed elements, and the zeros travel and are counted like any other element.

[Note: small pieces packed together] Unlike zero_runtime's units, which shard one flat buffer
into contiguous ranges, FSDP2 shards every parameter along dim 0, so a LayerNorm of ``d``
weights leaves ``d / world`` elements in *every* row, and aligning each such piece costs
nearly ``A`` zeros per piece and row: a pre-LN MLP block of hidden size 64 on 4 ranks would
grow 11%. When full alignment is over the budget, the staged row therefore keeps the pieces
of at least ``A`` elements aligned, in FSDP2's order, and packs the pieces of fewer than ``A``
after them (the row's order is the copy's own; the copy back restores FSDP2's): a block then
holds either part of one large parameter or small pieces only (LayerNorm weights, biases),
never small pieces next to large Linear weights, whose small gradients would round to zero
under the larger scale. Beyond the budget even then, the unit stays packed. The copies in and out are one pass
over the unit's buffers each, on the device and stream of the data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

# The largest share of a unit's packed elements that aligning it may add: zero_runtime's
# ALIGN_BUDGET (one rule for both; tests/collectives/test_fsdp_zeropp.py checks they agree).
ALIGN_BUDGET = 1 / 32


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class BlockLayout:
    """Where each parameter's piece of one row of FSDP2's flat buffer goes in the aligned row.

    ``numels``: the elements of each parameter's piece of a row (its padded shard), in
    FSDP2's order; ``align``: the multiple every piece starts at in the aligned row, except
    pieces of fewer than ``pack_below`` elements, packed after the others ([Note: small
    pieces packed together]; 0: every piece aligned).
    """

    def __init__(self, numels: Sequence[int], *, align: int, pack_below: int = 0) -> None:
        assert align > 1 and numels, (align, numels)
        self.numels = tuple(int(n) for n in numels)
        self.align = align
        self.pack_below = pack_below
        self.numel = sum(self.numels)  # one row of FSDP2's buffer
        self.offsets = tuple(sum(self.numels[:i]) for i in range(len(self.numels)))
        aligned, end = [0] * len(self.numels), 0
        for i in sorted(range(len(self.numels)), key=lambda i: self.numels[i] < pack_below):
            if self.numels[i] >= pack_below:
                end = _round_up(end, align)
            aligned[i] = end
            end += self.numels[i]
        self.aligned_offsets = tuple(aligned)
        self._end = end

    def row_numel(self, stages: int = 1) -> int:
        """Elements of one aligned row whose ``stages`` equal parts each start at a multiple of ``align``."""
        return _round_up(max(self._end, 1), self.align * stages)

    def pad(self, flat: torch.Tensor, *, rows: int, stages: int = 1) -> torch.Tensor:
        """A new zero-padded aligned copy of ``flat`` (``rows`` rows of FSDP2's layout), flat."""
        width = self.row_numel(stages)
        staged = torch.zeros(rows, width, dtype=flat.dtype, device=flat.device)
        source = flat.view(rows, self.numel)
        for offset, aligned, n in zip(self.offsets, self.aligned_offsets, self.numels, strict=True):
            staged[:, aligned : aligned + n].copy_(source[:, offset : offset + n])
        return staged.view(-1)

    def unpad(self, staged: torch.Tensor, out: torch.Tensor, *, rows: int) -> None:
        """Write the aligned ``staged`` (``rows`` rows) back into ``out`` in FSDP2's layout."""
        source = staged.view(rows, -1)
        target = out.view(rows, self.numel)
        for offset, aligned, n in zip(self.offsets, self.aligned_offsets, self.numels, strict=True):
            target[:, offset : offset + n].copy_(source[:, aligned : aligned + n])


def aligned_layout(numels: Sequence[int], *, align: int) -> BlockLayout | None:
    """The aligned layout of a unit whose row holds pieces of ``numels`` elements: every piece
    aligned if that adds at most :data:`ALIGN_BUDGET` of the packed elements, else the pieces of
    at least ``align`` elements aligned and the smaller ones packed after them if that does
    ([Note: small pieces packed together]); None when neither does, ``align`` is 1 or the unit
    is empty."""
    packed = sum(numels)
    if align <= 1 or packed == 0:
        return None
    for pack_below in (0, align):
        layout = BlockLayout(numels, align=align, pack_below=pack_below)
        if layout.row_numel() - packed <= packed * ALIGN_BUDGET:
            return layout
    return None


def block_align(group_sizes: Sequence[int]) -> int:
    """The alignment that keeps groups of every size in ``group_sizes`` inside one parameter."""
    return math.lcm(1, *group_sizes)
