"""Fixtures shared by the collectives' tests.

The shared helpers (``spawn_harness``, ``collective_checks``, ``collective_oracles``) stay at
``tests/``: the runtime's tests use them too, and ``tests/`` is on ``sys.path`` (its
``conftest.py`` is loaded from there).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

import zcomm


@pytest.fixture
def world_timeout() -> timedelta:
    """The timeout of :func:`gloo_world`: distinct from torch's defaults, so inheriting it can be checked."""
    return timedelta(seconds=17)


@pytest.fixture
def gloo_world(world_timeout: timedelta) -> Iterator[dist.ProcessGroup]:
    """A 1-rank gloo world in this process, for what needs a process group but no peer (no spawn)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=world_timeout)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def one_rank() -> zcomm.Topology:
    return zcomm.Topology(world_size=1, local_size=1)
