"""The handle an ``async_op=True`` zcomm collective returns, like torch's ``Work``.

A zcomm collective is a chain (quantize, communicate, dequantize); the handle owns the
tail of that chain that must run before ``output`` is valid: waiting for the
communication and, where the chain has one, the final dequantization. ``wait()`` runs that
tail exactly once (later calls return at once, or re-raise its error); on CUDA the tail is
only *enqueued* on the current stream, as with NCCL's ``Work.wait()``.

``is_completed()`` is, as for torch's ``Work.is_completed()``, whether the collective has
actually finished: the chain's end on the CPU worker, or the chain's end event on the GPU.
It does not follow ``wait()``: on CUDA ``wait()`` returns once the tail is enqueued, long
before the GPU gets there.
"""

from __future__ import annotations

import threading
from typing import Callable


class Handle:
    """``wait()`` makes ``output`` valid (on CUDA: for the current stream); ``is_completed()`` says whether
    the collective has finished (``ready()``, the worker's future or the GPU's end event)."""

    def __init__(self, *, finish: Callable[[], None], ready: Callable[[], bool]) -> None:
        self._finish = finish
        self._ready = ready
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None

    def wait(self) -> bool:
        with self._lock:
            if not self._done:
                self._done = True
                try:
                    self._finish()
                except BaseException as exc:
                    self._error = exc
            if self._error is not None:
                raise self._error
        return True

    def is_completed(self) -> bool:
        return bool(self._ready())
