"""Counts read from environment variables, with errors that name the variable."""

from __future__ import annotations

import os


def positive_int_from_env(variable: str, counts: str) -> int | None:
    """``$variable`` as a positive int (surrounding blanks allowed); None when unset or blank.

    ``ValueError`` names the variable, its value and what it ``counts`` (e.g. "threads").
    """
    text = os.environ.get(variable, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"${variable}={text!r} is not an integer number of {counts}") from None
    if value < 1:
        raise ValueError(f"${variable}={value} must be >= 1")
    return value
