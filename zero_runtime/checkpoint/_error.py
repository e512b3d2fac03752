"""``CheckpointError``, apart so that ``checkpoint._sharded`` and ``checkpoint._reshard`` both raise it without an import cycle."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run (and nothing was changed)."""
