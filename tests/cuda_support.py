"""Markers and tool lookup for the CUDA tests of every layer.

Every CUDA test that cannot run here is skipped with the reason (``-ra`` in setup.cfg
prints it): the nvcc tests need ``nvcc``; the NVRTC tests need cupy and an NVRTC library
(no GPU); the tests of the ``cuda`` backend need a CUDA device, a CUDA build of torch and
cupy (:func:`zcomm_cuda.unavailable_reason` words what is missing); tests that only put
tensors on a GPU (the ``reference`` backend on CUDA) need a CUDA device seen by torch.

[Note: ZCOMM_GPU_CHECK] On a GPU machine a skipped GPU test hides a broken set-up (no cupy,
no NVRTC library), so ``make gpu-check`` sets ``ZCOMM_GPU_CHECK=1``: then ``requires_gpu``
and ``requires_nvrtc`` never skip, and a test whose requirement is missing fails, naming
what is missing. The markers stay ordinary ``skipif`` marks (usable as decorators, in
``pytestmark`` and in ``pytest.param(marks=...)``): under the variable their condition is
an object whose truth test raises, which pytest reports as a failure of the test with the
exception's message.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from zcomm_cuda import unavailable_reason
from zcomm_cuda.availability import nvrtc_problem

REPO = Path(__file__).resolve().parent.parent
GPU_CHECK_VARIABLE = "ZCOMM_GPU_CHECK"


def _find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


class RequirementMissing:
    """A skipif condition that fails the test instead: see [Note: ZCOMM_GPU_CHECK]."""

    def __init__(self, what: str, reason: str) -> None:
        self.message = f"{GPU_CHECK_VARIABLE}=1 and {what} cannot run here: {reason}"

    def __bool__(self) -> bool:
        raise RuntimeError(self.message)


def _gpu_check_mark(what: str, reason: str | None) -> pytest.MarkDecorator:
    """Skip when ``reason`` is not None, or fail under ZCOMM_GPU_CHECK=1."""
    if reason is not None and os.environ.get(GPU_CHECK_VARIABLE) == "1":
        return pytest.mark.skipif(RequirementMissing(what, reason), reason=f"{what}: {reason}")
    return pytest.mark.skipif(reason is not None, reason=f"{what} cannot run on this machine: {reason}")


NVCC = _find_nvcc()
GPU_UNAVAILABLE = unavailable_reason()
NVRTC_UNAVAILABLE = nvrtc_problem()
CUDA_DEVICE_UNAVAILABLE = None if torch.cuda.is_available() else f"torch {torch.__version__} sees no CUDA device"

requires_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, /usr/local/cuda/bin): cannot compile the CUDA sources")
requires_gpu = _gpu_check_mark("the cuda backend", GPU_UNAVAILABLE)
requires_nvrtc = _gpu_check_mark("NVRTC (cupy)", NVRTC_UNAVAILABLE)
requires_cuda_device = _gpu_check_mark("CUDA tensors", CUDA_DEVICE_UNAVAILABLE)
