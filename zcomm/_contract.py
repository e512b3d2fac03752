"""The contracts between zcomm's collectives and the code that runs them.

* :class:`GroupInfo`: what a collective needs to know of the caller's group (this rank, the
  size, the topology), resolved by :func:`zcomm._prologue.prologue`;
* :data:`Chain`: a collective's work after its prologue, a call with its tensors bound,
  which :func:`zcomm._chain_runner.run_chain` runs in order on every rank;
* :data:`Kind`: which of zcomm's independent streams of collectives a chain belongs to
  (``"gather"``: qwZ; ``"reduce"``: qgZ), each with its own private subgroups and ordering;
* :class:`Handle`: what an ``async_op=True`` collective returns (public as ``zcomm.Handle``).

It imports only :mod:`zcomm.topology`, a leaf, so every implementation can import it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal, NamedTuple

from .topology import Topology

# chain(): runs every hop of one call and leaves the result in that call's output(s)
Chain = Callable[[], None]

# [Note: kinds] zcomm's gathers and reductions never share a private subgroup, a CPU worker or
# an order: a gather does not wait for a reduce-scatter issued before it (see zcomm._chain_runner)
Kind = Literal["gather", "reduce"]
KINDS: tuple[Kind, ...] = ("gather", "reduce")


class GroupInfo(NamedTuple):
    """What a collective needs to know of the caller's group: this rank in it, its size, its topology.

    It does not hold the group: the collectives' caches keep GroupInfos (and the plans that
    hold them) per group, and a cached value that held its group would keep it alive for good
    ([Note: plan cache lifetime] in :mod:`zcomm._plan_cache`). The group itself is the caller's
    argument, which each call passes on where it is needed.
    """

    rank: int
    world_size: int
    topology: Topology


class Handle:
    """The handle an ``async_op=True`` zcomm collective returns, like torch's ``Work``.

    A zcomm collective is a chain (quantize, communicate, dequantize); the handle owns the
    tail of that chain that must run before ``output`` is valid: waiting for the
    communication and, where the chain has one, the final dequantization. ``wait()`` runs
    that tail exactly once (later calls return at once, or re-raise its error); on CUDA the
    tail is only *enqueued* on the current stream, as with NCCL's ``Work.wait()``.

    ``is_completed()`` is, as for torch's ``Work.is_completed()``, whether the collective
    has actually finished (``ready()``: the chain's end on the CPU worker, or the chain's end
    event on the GPU). It does not follow ``wait()``: on CUDA ``wait()`` returns once the
    tail is enqueued, long before the GPU gets there.
    """

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
