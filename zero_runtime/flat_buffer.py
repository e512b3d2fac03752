"""Flat, aligned, padded layout of a group of parameters of arbitrary shapes.

A unit's parameters are laid end to end in one contiguous buffer. Each parameter starts at
an offset aligned to ``alignment`` elements, and the total is padded up to a multiple of
``world_size * alignment`` so that the buffer splits into ``world_size`` equal shards whose
sizes are themselves multiples of ``alignment`` (quantized collectives need whole groups per
shard). Padding is zero in every buffer that follows this layout, so it never contributes to
norms, reductions or optimizer updates.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


class Slot(NamedTuple):
    """Where one parameter lives in the flat buffer."""

    offset: int
    numel: int
    shape: torch.Size


class FlatLayout:
    def __init__(self, shapes: Sequence[torch.Size], *, world_size: int, alignment: int = 1) -> None:
        if world_size < 1 or alignment < 1:
            raise ValueError(f"world_size and alignment must be >= 1, got {world_size}, {alignment}")
        slots, offset = [], 0
        for shape in shapes:
            shape = torch.Size(shape)
            slots.append(Slot(offset, shape.numel(), shape))
            offset = _round_up(offset + shape.numel(), alignment)
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.world_size = world_size
        self.numel = _round_up(max(offset, 1), world_size * alignment)
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
        for view, tensor in zip(self.views(flat), tensors):
            view.copy_(tensor)
        return flat


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
