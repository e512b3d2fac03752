"""The NVMe optimizer step's pipeline: sub-groups read into host buffers, updated, written back.

[Note: swap pipeline] Sub-groups are numbered in the order they are added (all at once in
``step()``, or unit by unit as gradients become final during backward; see [Note: step
during backward] in ``offload._optimizer``). Sub-group ``j`` is read into buffer ``j % count``. Before
sub-group ``i`` is updated, the reads of ``i + 1 .. i + ahead`` are started, with
``ahead = count - 2``: together with ``i`` they fill ``count - 1`` buffers, and the last
one holds the write of ``i - 1``, still in flight (``buffer_count`` is at least 3; fewer
buffers are made only when there are fewer sub-groups, and then nothing is read ahead). A read into a buffer first waits for the
write that last used it (that of ``j - count``, started two updates earlier), so the read of
the next sub-groups and the write of the previous one both overlap the update of ``i``
(ZeRO-Infinity's overlap-centric design) and at most ``count`` sub-groups are in host memory.

Added sub-groups are updated only while the read-ahead window is full (``i + ahead`` has
been added): during backward the last ``ahead`` sub-groups wait, with their reads in flight,
for the next gradients, and ``drain`` updates them at the end. So when a bucket's units
bring at most ``ahead`` sub-groups, every read started during backward is waited for in a
later ``add``, after a bucket's worth of backward compute; a larger bucket waits for some
reads it started itself (more buffers, or a smaller ``sub_group_size``, avoid that). Every
action happens at a fixed point of the sequence of ``add`` calls, never depending on whether
a transfer has finished, which keeps the parameter offload's decisions (the update writes stage-3 shards) the same on every rank (see [Note:
matched decisions] in ``offload._params``). ``drain`` returns once every write is done, so a
checkpoint or an exception after it finds the file complete.
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch


class _Transfer(Protocol):
    def wait(self) -> None: ...


class SwapStream:
    """One step's pipeline over ``buffers``: ``io(item, buffer, write=...)`` starts a transfer,
    ``region(buffer, item)`` gives the views ``update(item, *views)`` works on."""

    def __init__(self, *, buffers: Sequence[torch.Tensor], io: Callable[..., _Transfer],
                 region: Callable[[torch.Tensor, object], list[torch.Tensor]],
                 update: Callable[..., None]) -> None:
        self.buffers = list(buffers)
        self.io, self.region, self.update = io, region, update
        self.ahead = max(0, len(self.buffers) - 2)  # fewer than 3 buffers: only when there are fewer sub-groups
        self.items: list[object] = []
        self.read_next = 0  # next item whose read starts
        self.updated = 0  # items updated (the next one to update)
        self._reads: dict[int, _Transfer] = {}
        self._writes: dict[int, _Transfer] = {}

    def add(self, items: Sequence[object]) -> None:
        """Queue ``items`` and update those whose read-ahead window is full."""
        self.items.extend(items)
        self._advance(drain=False)

    def drain(self) -> None:
        """Update everything queued and wait for every write."""
        self._advance(drain=True)
        self.settle()

    def settle(self) -> None:
        """Wait for every transfer in flight (also after a failure: nothing may still write
        into a buffer or the file once the caller moves on)."""
        transfers = [*self._reads.values(), *self._writes.values()]
        self._reads.clear()
        self._writes.clear()
        errors = []
        for transfer in transfers:
            try:
                transfer.wait()
            except BaseException as err:  # wait for the others before raising
                errors.append(err)
        if errors:
            raise errors[0]

    def _advance(self, *, drain: bool) -> None:
        while self.updated < len(self.items):
            while self.read_next < min(len(self.items), self.updated + self.ahead + 1):
                self._start_read(self.read_next)
            if not drain and self.updated + self.ahead >= len(self.items):
                return
            i = self.updated
            buffer = self.buffers[i % len(self.buffers)]
            self._reads.pop(i).wait()
            self.update(self.items[i], *self.region(buffer, self.items[i]))
            self._writes[i] = self.io(self.items[i], buffer, write=True)
            self.updated += 1

    def _start_read(self, j: int) -> None:
        previous = j - len(self.buffers)
        assert previous < self.updated, "a buffer is read into before its sub-group was updated"
        if previous in self._writes:
            self._writes.pop(previous).wait()
        self._reads[j] = self.io(self.items[j], self.buffers[j % len(self.buffers)], write=False)
        self.read_next = j + 1
