"""The runtime tests' use of the shared ``tests/spawn_harness.py``.

``run(fn, world_size, *args, env=...)`` runs ``fn(rank, world_size, *args)`` on fresh gloo ranks and
returns the per-rank results; ``initialize_one_rank`` runs the runtime in this process, on a
1-rank gloo group (the ``single_process`` fixture destroys it). Results travel as ``torch.save`` bytes: tensors pickled onto a
multiprocessing queue travel as shared-memory handles owned by the rank process, which
exits right after reporting.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist

from spawn_harness import run_distributed
from zero_workloads import make_optimizer

TIMEOUT = 600.0  # generous: the CI machine's two cores are shared with other test processes


def _serialized(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(fn(rank, world_size, *args), buffer)
    return buffer.getvalue()


def run(fn: Callable[..., Any], world_size: int, *args: Any, env: Mapping[str, str] | None = None) -> list[Any]:
    """``env``: variables set in every rank before torch.distributed starts."""
    raw = run_distributed(_serialized, world_size, args=(fn, *args), env=env, timeout=TIMEOUT, pg_timeout=TIMEOUT)
    return [torch.load(io.BytesIO(blob), weights_only=False) for blob in raw]


def initialize_one_rank(model: torch.nn.Module, config: Mapping[str, Any], optimizer: Any = None):
    """``zero_runtime.initialize`` in this process, on a 1-rank gloo group made if none exists."""
    import zero_runtime

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    return zero_runtime.initialize(model, optimizer or make_optimizer(), config)
