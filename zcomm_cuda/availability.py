"""Whether the CUDA kernels can run on this machine, and if not, what is missing.

Imports nothing heavy at module level: ``cupy`` is only imported when asked, so
``import zcomm_cuda`` works on a machine with no GPU and no cupy.
"""

from __future__ import annotations

import torch


def _cupy_problem() -> str | None:
    try:
        import cupy
    except ImportError as exc:
        return f"cupy is not importable ({exc}); install the cuda extra: pip install 'zcomm[cuda]' (cupy-cuda12x)"
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
    and a GPU behind a working driver), then the ``cupy`` package (the ``cuda`` extra,
    ``cupy-cuda12x``) and its own access to the driver.
    """
    problems = [p for p in (_torch_problem(), _cupy_problem()) if p is not None]
    return "; ".join(problems) or None
