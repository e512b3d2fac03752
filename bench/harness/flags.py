"""What the command lines of the suites share: sizes in nccl-tests' spelling, former flag spellings."""

from __future__ import annotations

import argparse
import re
from typing import Any, Sequence

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)B?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864: an integer with an optional ``K``/``M``/``G`` suffix (powers of 1024, as in nccl-tests)."""
    match = _SIZE_RE.match(str(text))
    if match is None:
        raise ValueError(f"size must be an integer with an optional K/M/G suffix, got {text!r}")
    return int(match.group(1)) * _SUFFIX[match.group(2).upper()]


class _RenamedFlag(argparse.Action):
    """A flag's former spelling: giving it (with or without a value) exits with an error naming the new one."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        parser.error(f"{option_string} was renamed {self.new}")


def add_renamed_flag(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Keep ``old`` as a hidden flag whose use is a usage error (status 2) that names ``new``.

    Without it argparse would also take ``old`` as an abbreviation of ``new`` where it is a
    prefix (``--local`` of ``--local-size``), silently.
    """
    parser.add_argument(old, action=_RenamedFlag, new=new, dest=f"renamed_{old.lstrip('-').replace('-', '_')}")
