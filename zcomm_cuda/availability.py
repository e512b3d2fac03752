"""Whether the CUDA kernels can run (or be compiled) on this machine, and if not, what is missing.

Imports nothing heavy at module level: ``cupy`` is only imported when asked, so
``import zcomm_cuda`` works on a machine with no GPU and no cupy.
"""

from __future__ import annotations

import torch


def _cupy_package() -> str:
    """The cupy wheel that matches torch's CUDA (``cupy-cuda12x`` for CUDA 12, ...)."""
    major = (torch.version.cuda or "13").split(".")[0]
    return f"cupy-cuda{major}x"


def nvrtc_problem() -> str | None:
    """``None`` when cupy can run NVRTC here (no GPU needed), else what is missing, in words.

    cupy finds the NVRTC library of its CUDA major version on the library path or in the
    ``nvidia-cuda-nvrtc`` wheel (which CUDA builds of torch install).
    """
    try:
        from cupy.cuda import nvrtc
    except ImportError as exc:
        return f"cupy is not importable ({exc}); install {_cupy_package()} (the package matching torch's CUDA)"
    try:
        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001  (cupy raises its own error types, or the loader's)
        return f"cupy cannot load the NVRTC library ({type(exc).__name__}: {exc})"
    return None


def _driver_problem() -> str | None:
    import cupy

    try:
        cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as exc:
        return f"cupy cannot reach the CUDA driver ({exc})"
    return None


def _torch_problem() -> str | None:
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build (no CUDA support compiled in)"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (no GPU, or the NVIDIA driver is missing or too old)"
    return None


def unavailable_reason() -> str | None:
    """``None`` when the cuda backend can run here, else what is missing, in words.

    Checks, and names every one that fails: torch's CUDA support and device (a CUDA build
    and a GPU behind a working driver), then cupy (the package matching torch's CUDA, e.g.
    ``cupy-cuda13x``) with its NVRTC library and its own access to the driver.
    """
    problems = [_torch_problem()]
    cupy_problem = nvrtc_problem()
    problems.append(cupy_problem if cupy_problem is not None else _driver_problem())
    return "; ".join(p for p in problems if p is not None) or None
