"""Skip markers and tool lookup for the CUDA tests (imported by the test_cuda_* modules).

Every CUDA test that cannot run here is skipped with the reason (``-ra`` in setup.cfg
prints it): the compile and host-math tests need ``nvcc``; the GPU tests need a CUDA
device, a CUDA build of torch and cupy (:func:`zcomm_cuda.unavailable_reason` words it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from zcomm_cuda import unavailable_reason

REPO = Path(__file__).resolve().parent.parent


def _find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


NVCC = _find_nvcc()
GPU_UNAVAILABLE = unavailable_reason()

requires_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, /usr/local/cuda/bin): cannot compile the CUDA sources")
requires_gpu = pytest.mark.skipif(
    GPU_UNAVAILABLE is not None, reason=f"cuda backend cannot run on this machine: {GPU_UNAVAILABLE}"
)
