"""The runtime tests' use of the shared ``tests/spawn_harness.py``.

``run(fn, world_size, *args, env=...)`` runs ``fn(rank, world_size, *args)`` on fresh gloo ranks and
returns the per-rank results. Results travel as ``torch.save`` bytes: tensors pickled onto a
multiprocessing queue travel as shared-memory handles owned by the rank process, which
exits right after reporting.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Mapping

import torch

from spawn_harness import run_distributed

TIMEOUT = 600.0  # generous: the CI machine's two cores are shared with other test processes


def _serialized(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(fn(rank, world_size, *args), buffer)
    return buffer.getvalue()


def run(fn: Callable[..., Any], world_size: int, *args: Any, env: Mapping[str, str] | None = None) -> list[Any]:
    """``env``: variables set in every rank before torch.distributed starts."""
    raw = run_distributed(_serialized, world_size, args=(fn, *args), env=env, timeout=TIMEOUT, pg_timeout=TIMEOUT)
    return [torch.load(io.BytesIO(blob), weights_only=False) for blob in raw]
