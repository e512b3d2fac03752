"""Flat, padded layout of a group of parameters of arbitrary shapes.

A unit's parameters are laid end to end in one contiguous buffer, and the total is padded
up to a multiple of ``world_size`` so that the buffer splits into ``world_size`` equal
shards. Shards are not aligned to quantization groups (see [Note: shards are not padded to
groups] in ``_quantized_comm``). Padding is zero in every buffer that follows this layout,
so it never contributes to norms, reductions or optimizer updates.
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
    def __init__(self, shapes: Sequence[torch.Size], *, world_size: int) -> None:
        assert world_size >= 1, world_size
        slots, offset = [], 0
        for shape in shapes:
            shape = torch.Size(shape)
            slots.append(Slot(offset, shape.numel(), shape))
            offset += shape.numel()
        self.slots: tuple[Slot, ...] = tuple(slots)
        self.world_size = world_size
        self.numel = -(-max(offset, 1) // world_size) * world_size
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
