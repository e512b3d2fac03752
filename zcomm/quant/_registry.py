"""The quantization backends: their names, the devices they run on, selection and loading.

Three backends implement the kernel contract of :mod:`zcomm.quant._contract`: ``reference``
(plain torch, the oracle, on CPU and CUDA tensors), ``cpu`` (numba) and ``cuda`` (the kernels
of :mod:`zcomm_cuda`). Each lives in a module of :mod:`zcomm.quant.backends` that registers
its kernels when imported, and is imported on the first op that runs it, so ``import zcomm``
needs neither numba nor cupy nor a GPU. A backend that cannot be loaded raises
:class:`BackendUnavailableError` naming what is missing: there is never a silent fallback to
another backend.

Selection (:func:`select`), in order: the op's ``backend=`` argument, the ``ZCOMM_BACKEND``
environment variable (read at every call of a public op; the quantized collectives read it
once per plan, when a group first sees a call shape), then the tensor's device (``cpu`` -> ``"cpu"``,
``cuda`` -> ``"cuda"``). The device's own backend runs behind ``torch.ops.zcomm``, the
``reference`` backend behind ``torch.ops.zcomm_reference`` ([Note: backend dispatch] in
:mod:`zcomm.quant._contract`), so choosing a backend is choosing an operator namespace.
"""

from __future__ import annotations

import importlib
import os
from typing import NamedTuple

import torch

BACKEND_VARIABLE = "ZCOMM_BACKEND"


class _Backend(NamedTuple):
    module: str  # imported to register the backend's kernels
    device_types: frozenset[str]


_BACKENDS: dict[str, _Backend] = {
    "reference": _Backend("zcomm.quant.backends.reference", frozenset({"cpu", "cuda"})),
    "cpu": _Backend("zcomm.quant.backends.cpu", frozenset({"cpu"})),
    "cuda": _Backend("zcomm.quant.backends.cuda", frozenset({"cuda"})),
}
_DEFAULT_FOR_DEVICE = {"cpu": "cpu", "cuda": "cuda"}
DEVICE_TYPES: tuple[str, ...] = tuple(sorted(set().union(*(b.device_types for b in _BACKENDS.values()))))


class BackendUnavailableError(RuntimeError):
    """The selected backend cannot run here (a missing package, library or device)."""


def check(name: str, device_type: str) -> None:
    """``ValueError`` unless ``name`` is a backend that runs on ``device_type`` tensors."""
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {name!r}")
    if device_type not in _BACKENDS[name].device_types:
        raise ValueError(
            f"backend {name!r} runs on {sorted(_BACKENDS[name].device_types)} tensors, got a {device_type} tensor"
        )


def select(backend: str | None, device: torch.device) -> str:
    """The backend that runs an op on ``device``: the argument, then ``$ZCOMM_BACKEND``, then the device's."""
    name = backend if backend is not None else os.environ.get(BACKEND_VARIABLE) or None
    if name is None:
        name = _DEFAULT_FOR_DEVICE.get(device.type)
        if name is None:
            raise ValueError(f"no zcomm quantization backend for device type {device.type!r}")
    check(name, device.type)
    return name


def _import(name: str) -> None:
    """Import backend ``name``'s module (registering its kernels); ``ImportError`` says why it cannot run."""
    importlib.import_module(_BACKENDS[name].module)


def load(name: str) -> None:
    """Make sure backend ``name`` has registered its kernels, or raise :class:`BackendUnavailableError`."""
    try:
        _import(name)
    except ImportError as exc:
        module = _BACKENDS[name].module
        message = f"zcomm backend {name!r} is unavailable: importing {module} failed ({exc})"
        raise BackendUnavailableError(message) from exc


def available_backends() -> dict[str, str]:
    """Each backend's status on this machine: ``"ok"`` or why it cannot load."""
    status = {}
    for name in _BACKENDS:
        try:
            _import(name)
            status[name] = "ok"
        except ImportError as exc:
            status[name] = f"unavailable: {exc}"
    return status


def backend_device_types() -> dict[str, tuple[str, ...]]:
    """Each backend's name and the device types of the tensors it runs on (``"cpu"``, ``"cuda"``)."""
    return {name: tuple(sorted(backend.device_types)) for name, backend in _BACKENDS.items()}
