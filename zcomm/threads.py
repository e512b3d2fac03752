"""Transitional alias of :mod:`zcomm._threads` for ``zcomm/quant/backends/cpu.py``, which imports
``...threads`` and is refactored on another branch; delete this file once it imports ``..._threads``."""

from ._threads import NUM_THREADS_VARIABLE, kernel_threads

__all__ = ["NUM_THREADS_VARIABLE", "kernel_threads"]
