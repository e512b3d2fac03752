"""Errors for config keys the runtime does not know, with a "did you mean" for near misses.

Every config section (the top level, ``zero_optimization``, ``fp16``, ``offload_optimizer``,
``aio``, ``activation_checkpointing``, ``optimizer`` / ``scheduler`` and their ``params``)
rejects unknown keys the same way: one ``ValueError`` listing all of them by their dotted
path, each followed by the closest known key of its own section when one is close enough
(``difflib``'s similarity ratio of at least 0.75, so ``stgae`` suggests ``stage`` but an
unrelated key suggests nothing).
"""

from __future__ import annotations

import difflib
from typing import Iterable

_CUTOFF = 0.75


def did_you_mean(key: str, known: Iterable[str]) -> str:
    """`` (did you mean X?)`` for the known key closest to ``key``, or "" if none is close."""
    match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=_CUTOFF)
    return f" (did you mean {match[0]}?)" if match else ""


def describe_unknown(section: str, key: str, known: Iterable[str]) -> str:
    """``section.key`` (or ``key`` at the top level) with its suggestion, if any."""
    prefix = f"{section}." if section else ""
    suggestion = did_you_mean(key, known)
    return f"{prefix}{key}{suggestion.replace('mean ', f'mean {prefix}', 1) if suggestion else ''}"


def unknown_keys_error(section: str, keys: Iterable[str], known: Iterable[str]) -> ValueError:
    """One error naming every unknown key of ``section``, sorted, with suggestions."""
    known = list(known)
    return ValueError("unknown config keys: "
                      + ", ".join(describe_unknown(section, key, known) for key in sorted(keys)))
