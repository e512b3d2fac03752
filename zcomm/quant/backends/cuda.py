"""The ``cuda`` backend: the CUDA kernels of :mod:`zcomm_cuda`, registered for the five ops, and their planner ([Note: planned kernels]).

Importing this module is what selecting ``backend="cuda"`` does on first use. When the
backend cannot run here it raises ``ImportError`` naming what is missing (cupy, its NVRTC
library, a CUDA device, the driver, a CUDA build of torch); the registry turns that into a
``BackendUnavailableError`` with the same words, and never falls back to another backend.
The launching code is :mod:`zcomm.quant.backends._cuda_launch`; this module and that one
are the only importers of :mod:`zcomm_cuda`, and only the registry imports them.
"""

from __future__ import annotations

from zcomm_cuda import unavailable_reason

from .._contract import SCHEMAS, implements, plans_kernels

_REASON = unavailable_reason()
if _REASON is not None:
    raise ImportError(f"the cuda backend cannot run here: {_REASON}")

from . import _cuda_launch  # noqa: E402  (needs the checks above to have passed)

for _op in SCHEMAS:
    implements(_op, "cuda")(getattr(_cuda_launch, _op))
plans_kernels("cuda")(_cuda_launch.plan_kernels)
