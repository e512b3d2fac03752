"""Backend registry for the block-quantization ops.

Each op is defined once in :mod:`zcomm.quant.ops` (validation, output allocation); each
backend module registers a kernel per op with :func:`register`. Backend modules are
imported lazily, on the first call that selects them, so ``import zcomm`` needs neither
numba nor cupy nor a GPU. A backend that cannot be loaded raises
:class:`BackendUnavailableError` naming what is missing: there is never a silent fallback
to another backend.

Selection, in order: the op's ``backend=`` argument, the ``ZCOMM_BACKEND`` environment
variable, then the tensor's device (``cpu`` -> ``"cpu"``, ``cuda`` -> ``"cuda"``).
"""

from __future__ import annotations

import importlib
import os
from typing import Callable

import torch

OPS = ("quantize", "dequantize", "reorder_quantize", "dequant_reduce")

# backend name -> (module that registers it, device types it accepts)
BACKENDS: dict[str, tuple[str, frozenset[str]]] = {
    "reference": ("zcomm.quant.backends.reference", frozenset({"cpu", "cuda"})),
    "cpu": ("zcomm.quant.backends.cpu", frozenset({"cpu"})),
    "cuda": ("zcomm.quant.backends.cuda", frozenset({"cuda"})),
}
DEFAULT_BACKEND_FOR_DEVICE = {"cpu": "cpu", "cuda": "cuda"}

_KERNELS: dict[tuple[str, str], Callable[..., None]] = {}


class BackendUnavailableError(RuntimeError):
    """The selected backend cannot run here (a missing package, library or device)."""


def register(op: str, backend: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorator: register ``fn`` as ``backend``'s kernel for ``op``."""
    assert op in OPS, op
    assert backend in BACKENDS, backend

    def decorator(fn: Callable[..., None]) -> Callable[..., None]:
        _KERNELS[(op, backend)] = fn
        return fn

    return decorator


def backend_name(backend: str | None, device: torch.device) -> str:
    """The backend that will run an op on ``device`` (argument, then env, then device)."""
    name = backend if backend is not None else os.environ.get("ZCOMM_BACKEND") or None
    if name is None:
        name = DEFAULT_BACKEND_FOR_DEVICE.get(device.type)
        if name is None:
            raise ValueError(f"no zcomm quantization backend for device type {device.type!r}")
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    if device.type not in BACKENDS[name][1]:
        raise ValueError(
            f"backend {name!r} runs on {sorted(BACKENDS[name][1])} tensors, got a {device.type} tensor"
        )
    return name


def lookup(op: str, backend: str | None, device: torch.device) -> Callable[..., None]:
    """The kernel for ``op`` on ``device``, importing its backend module on first use."""
    name = backend_name(backend, device)
    if (op, name) not in _KERNELS:
        module = BACKENDS[name][0]
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise BackendUnavailableError(
                f"zcomm backend {name!r} is unavailable: importing {module} failed ({exc})"
            ) from exc
    kernel = _KERNELS.get((op, name))
    if kernel is None:
        raise BackendUnavailableError(f"zcomm backend {name!r} has no kernel for {op!r}")
    return kernel


def available_backends() -> dict[str, str]:
    """Each backend's status on this machine: ``"ok"`` or why it cannot load."""
    status = {}
    for name, (module, _) in BACKENDS.items():
        try:
            importlib.import_module(module)
            status[name] = "ok"
        except (ImportError, BackendUnavailableError) as exc:
            status[name] = f"unavailable: {exc}"
    return status
