"""The handle an ``async_op=True`` zcomm collective returns, like torch's ``Work``.

A zcomm collective is a chain (quantize, communicate, dequantize); the handle owns the
tail of that chain that must run before ``output`` is valid: waiting for the
communication and, where the chain has one, the final dequantization. ``wait()`` runs that
tail exactly once (later calls return at once, or re-raise its error); on CUDA the tail is
only *enqueued* on the current stream, as with NCCL's ``Work.wait()``.
"""

from __future__ import annotations

import threading
from typing import Callable


class Handle:
    """``wait()`` makes ``output`` valid; ``is_completed()`` says whether ``wait()`` would block on communication."""

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
        return self._done or bool(self._ready())
