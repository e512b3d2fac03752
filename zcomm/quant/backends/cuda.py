"""The ``cuda`` backend: the CUDA kernels of :mod:`zcomm_cuda`, registered for the four ops.

Importing this module is what selecting ``backend="cuda"`` does on first use. When the
backend cannot run here it raises ``ImportError`` naming what is missing (cupy, its NVRTC
library, a CUDA device, the driver, a CUDA build of torch); the registry turns that into a
``BackendUnavailableError`` with the same words, and never falls back to another backend.
"""

from __future__ import annotations

from zcomm_cuda.availability import unavailable_reason

from ..registry import register

_REASON = unavailable_reason()
if _REASON is not None:
    raise ImportError(f"the cuda backend cannot run here: {_REASON}")

from zcomm_cuda import launchers  # noqa: E402  (needs the checks above to have passed)

for _op in ("quantize", "dequantize", "reorder_quantize", "dequant_reduce"):
    register(_op, "cuda")(getattr(launchers, _op))
