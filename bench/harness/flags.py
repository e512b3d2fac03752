"""What the command lines of the suites share: sizes in nccl-tests' spelling."""

from __future__ import annotations

import re

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864: an integer with an optional ``K``/``M``/``G`` suffix (powers of 1024, as in nccl-tests)."""
    match = _SIZE_RE.match(str(text))
    if match is None:
        raise ValueError(f"size must be an integer with an optional K/M/G suffix, got {text!r}")
    return int(match.group(1)) * _SUFFIX[match.group(2).upper()]
