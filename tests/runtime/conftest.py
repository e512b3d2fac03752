"""Fixtures shared by the runtime's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def single_process() -> Iterator[None]:
    """Destroys the 1-rank group a test made (``zero_harness.initialize_one_rank`` or its own
    ``init_process_group``), so the next test starts without one."""
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
