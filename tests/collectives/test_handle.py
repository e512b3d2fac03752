"""zcomm.Handle: ``is_completed()`` reports actual completion, as torch's ``Work.is_completed()`` does.

On CUDA ``wait()`` only enqueues the chain's tail on the current stream, so completion must
come from the readiness probe (the chain's end event), never from ``wait()`` having run.
A fake probe stands in for the event here.
"""

from __future__ import annotations

import pytest

from zcomm import Handle


class _FakeEvent:
    """A CUDA end event's ``query()``: False until the test says the GPU got there."""

    def __init__(self) -> None:
        self.reached = False

    def query(self) -> bool:
        return self.reached


def test_is_completed_follows_readiness_not_wait():
    event, finished = _FakeEvent(), []
    handle = Handle(finish=lambda: finished.append(True), ready=event.query)
    assert not handle.is_completed()
    assert handle.wait() is True
    assert finished == [True]
    assert not handle.is_completed(), "wait() only enqueued the tail: the GPU is not done"
    event.reached = True
    assert handle.is_completed()


def test_wait_runs_the_tail_once_and_reraises_its_error():
    calls = []

    def finish() -> None:
        calls.append(1)
        raise RuntimeError("hop failed")

    handle = Handle(finish=finish, ready=lambda: True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="hop failed"):
            handle.wait()
    assert calls == [1]
    assert handle.is_completed()
