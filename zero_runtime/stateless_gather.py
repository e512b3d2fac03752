"""The part of a ``ParamGather`` (see :mod:`zero_runtime.comm`) that keeps no parameter copies."""

from __future__ import annotations

from collections.abc import Hashable

import torch


class StatelessGather:
    """Base for gathers that only move bytes: nothing to refresh after forward, nothing to
    drop when the weights change, no bytes held between uses (unlike hpZ's secondaries)."""

    def after_forward(self, full: torch.Tensor, shard: torch.Tensor, *, unit: Hashable) -> None:
        pass

    def weights_changed(self) -> None:
        pass

    def held_bytes(self) -> int:
        return 0
