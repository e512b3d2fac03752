"""The NVMe step's pipeline (``_swap_stream.SwapStream``) with recording fake transfers: each
sub-group read, updated and written once, in order; a buffer reused only after its write is
done; never more than ``buffer_count`` sub-groups held; during backward (items added a few at
a time, no more than the reads ahead) no read waited for in the call that started it; everything waited for at the end,
after a failure too. The real file under it is tested in ``test_offload.py``."""

from __future__ import annotations

import pytest
import torch

from zero_runtime.offload._swap_stream import SwapStream


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.call = 0  # index of the add()/drain() call in progress
        self.holding: dict[int, object] = {}  # buffer -> item


class _Transfer:
    def __init__(self, log: _Log, kind: str, item: int, buffer: int) -> None:
        self.log, self.kind, self.item, self.buffer = log, kind, item, buffer
        self.started = log.call
        self.waited = None

    def wait(self) -> None:
        if self.waited is None:
            self.waited = self.log.call
            self.log.events.append(("wait", self.kind, self.item))
            if self.kind == "write":
                del self.log.holding[self.buffer]


def _stream(count: int, log: _Log, transfers: list[_Transfer], fail_at: int | None = None) -> SwapStream:
    buffers = [torch.full((1,), i) for i in range(count)]

    def io(item, buffer, *, write):
        index = int(buffer.item())
        if not write:
            assert index not in log.holding, f"buffer {index} read into while it holds {log.holding[index]}"
            log.holding[index] = item
        transfer = _Transfer(log, "write" if write else "read", item, index)
        transfers.append(transfer)
        log.events.append(("start", transfer.kind, item))
        return transfer

    def update(item, view):
        if item == fail_at:
            raise OSError("injected")
        assert log.holding[int(view.item())] == item
        log.events.append(("update", item))

    return SwapStream(buffers=buffers, io=io, region=lambda buffer, item: [buffer], update=update)


@pytest.mark.parametrize("count", [3, 4, 6])
@pytest.mark.parametrize("per_add", [1, 2, 5])
def test_order_reuse_and_no_wait_on_a_fresh_read(count, per_add):
    log, transfers = _Log(), []
    stream = _stream(count, log, transfers)
    items = list(range(17))
    for start in range(0, len(items), per_add):
        log.call += 1
        stream.add(items[start : start + per_add])
        assert len(log.holding) <= count
    log.call += 1
    drain_call = log.call
    stream.drain()
    assert [e[1] for e in log.events if e[0] == "update"] == items
    for kind in ("read", "write"):
        assert [t.item for t in transfers if t.kind == kind] == items
    assert all(t.waited is not None for t in transfers) and log.holding == {}
    if per_add <= count - 2:  # reads ahead cover an add: each read is waited for in a later call
        for t in transfers:
            if t.kind == "read" and t.waited != drain_call:
                assert t.waited > t.started, (t.item, t.started, t.waited)
    for i in items:  # each update follows its read and precedes its write
        assert (log.events.index(("wait", "read", i)) < log.events.index(("update", i))
                < log.events.index(("start", "write", i)))
    # while adding, the stream keeps count - 2 reads ahead of the updates
    updated_before_drain = sum(1 for t in transfers if t.kind == "write" and t.started < drain_call)
    assert updated_before_drain == len(items) - (count - 2)


def test_one_item_at_a_time_in_step_order_overlaps_read_ahead_and_write_behind():
    """All items at once (``step()``): the read of i + 1 is started before the update of i,
    and the write of i - 1 is still in flight during it."""
    log, transfers = _Log(), []
    stream = _stream(3, log, transfers)
    stream.add(list(range(6)))
    stream.drain()
    for i in range(1, 5):
        update = log.events.index(("update", i))
        assert log.events.index(("start", "read", i + 1)) < update
        assert log.events.index(("wait", "write", i - 1)) > update


def test_a_failed_update_leaves_nothing_in_flight():
    log, transfers = _Log(), []
    stream = _stream(4, log, transfers, fail_at=5)
    with pytest.raises(OSError, match="injected"):
        stream.add(list(range(10)))
    stream.settle()
    assert all(t.waited is not None for t in transfers)
    assert stream.updated == 5
