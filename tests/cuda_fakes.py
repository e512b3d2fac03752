"""The cuda backend's launch plans on a machine without a GPU: what its host-side tests stub out.

:func:`fake_launch_plans` replaces the three things a launch plan needs a GPU for
([Note: launch plans] in ``zcomm.quant.backends._cuda_launch``): compiling, loading and sizing
a kernel (every kernel's grid cap becomes ``max_blocks``; ``resolved`` records each
``(source, name, device index)`` resolved, in order), uploading a permutation and an address
table (CPU tensors instead), loading the sources (nothing), and the current device of ``cuda`` without an index (0). It
also gives the public ops a fresh cache of launch plans, so a test that changes a size limit
sees it. Launches themselves go to ``zcomm_cuda.loader.launch``, which each test replaces.
"""

from __future__ import annotations

import pytest
import torch

from zcomm.quant.backends import _cuda_launch as cuda_launch
from zcomm.quant.backends import _cuda_tables
from zcomm_cuda import loader


def fake_launch_plans(monkeypatch: pytest.MonkeyPatch, max_blocks: int = 1056) -> list[tuple[str, str, int]]:
    resolved: list[tuple[str, str, int]] = []

    def resolve_kernel(source: str, name: str, index: int) -> int:
        resolved.append((source, name, index))
        return max_blocks

    monkeypatch.setattr(cuda_launch, "resolve_kernel", resolve_kernel)
    monkeypatch.setattr(cuda_launch, "load_sources", lambda sources, device: None)
    monkeypatch.setattr(cuda_launch, "device_perm", lambda perm, device: torch.tensor(perm, dtype=torch.int64))
    monkeypatch.setattr(_cuda_tables.HeldTable, "for_tensors", lambda self, xs, parts: torch.tensor(
        _cuda_tables.interleaved_table(xs, parts), dtype=torch.int64))
    monkeypatch.setattr(loader, "device_index", lambda device: 0 if device.index is None else device.index)
    monkeypatch.setattr(cuda_launch, "OP_PLANS", cuda_launch.BoundedCache(cuda_launch.MAX_OP_PLANS))
    return resolved
