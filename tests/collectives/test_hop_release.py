"""A CPU chain completes only once gloo has let go of its hops' tensors ([Note: hop release]).

gloo's worker thread may drop the last reference to a finished hop's ``Work`` after the
chain's ``wait()`` returned; releasing the hop's tensors then takes the GIL, and if the
interpreter is finalizing by then the process aborts (``std::terminate``). A stand-in
collective here plays gloo: it keeps C++ references to the hop's tensors (views, which hold
their base) after its ``wait()`` returned, and a timer thread drops them later. The chain's
handle must not complete before that; a failed chain drops its hops without waiting; a
tensor that is never let go raises instead of hanging. One real gloo hop checks the counts
zcomm reads.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from zcomm import _chain_runner
from zcomm._torch_compat import all_gather_single, tensor_use_count

HELD_S = 0.2


class _LateRelease:
    """A collective whose ``Work`` is done at once while "its thread" keeps the tensors for ``held_s`` more
    seconds (forever for None); ``released`` is when it let them go."""

    def __init__(self, held_s: float | None) -> None:
        self.held_s, self.released, self.calls = held_s, None, 0

    def __call__(self, received: torch.Tensor, send: torch.Tensor, *, group: object, async_op: bool) -> object:
        assert async_op and group == "group"
        self.calls += 1
        kept = [received.view(-1), send.view(-1)]  # C++ references to both TensorImpls, as a gloo Work holds
        if self.held_s is not None:
            threading.Timer(self.held_s, self._release, (kept,)).start()
        else:
            self.forever = kept
        return _DoneWork()

    def _release(self, kept: list[torch.Tensor]) -> None:
        kept.clear()
        self.released = time.monotonic()


class _DoneWork:
    def wait(self) -> bool:
        return True


@pytest.fixture()
def worker():
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown()


def _chain(collective: _LateRelease, hops: int = 2, fail: bool = False):
    def chain() -> None:
        send = torch.ones(16)
        for _ in range(hops):
            received = torch.empty(16)
            _chain_runner.start_hop(collective, received, send, "group").wait()
            send = received
        if fail:
            raise ValueError("the chain failed")

    return chain


@pytest.mark.parametrize("async_op", (False, True))
def test_the_handle_completes_after_the_hops_tensors_are_let_go(worker, async_op) -> None:
    collective = _LateRelease(HELD_S)
    started = time.monotonic()
    handle = _chain_runner.run_chain(_chain(collective), [torch.empty(1)], async_op, worker)
    if handle is not None:
        handle.wait()
    finished = time.monotonic()
    assert collective.calls == 2 and collective.released is not None, "returned before the stand-in let go"
    assert finished >= collective.released >= started + HELD_S
    assert worker.submit(lambda: list(_chain_runner._HELD.hops)).result() == []  # nothing kept past the chain


def test_a_failed_chain_raises_its_error_without_waiting(worker) -> None:
    collective = _LateRelease(None)  # never lets go
    started = time.monotonic()
    with pytest.raises(ValueError, match="the chain failed"):
        _chain_runner.run_chain(_chain(collective, fail=True), [torch.empty(1)], False, worker)
    assert time.monotonic() - started < 5
    assert worker.submit(lambda: list(_chain_runner._HELD.hops)).result() == []


def test_a_tensor_never_let_go_raises(worker, monkeypatch) -> None:
    monkeypatch.setattr(_chain_runner, "_RELEASE_TIMEOUT_S", 0.1)
    with pytest.raises(RuntimeError, match=r"a hop's tensor of shape \(16,\) is still held"):
        _chain_runner.run_chain(_chain(_LateRelease(None), hops=1), [torch.empty(1)], False, worker)
    assert worker.submit(lambda: list(_chain_runner._HELD.hops)).result() == []


def test_a_real_gloo_hop_is_released_when_its_chain_completes(gloo_world, worker) -> None:
    """On gloo the counts start_hop keeps fall back once the chain is done, whichever thread dropped the Work."""
    seen = []

    def chain() -> None:
        send, received = torch.ones(8), torch.empty(8)
        _chain_runner.start_hop(all_gather_single, received, send, dist.group.WORLD).wait()
        seen.append((send, received))

    for _ in range(20):
        _chain_runner.run_chain(chain, [torch.empty(1)], False, worker)
        send, received = seen.pop()
        assert (tensor_use_count(send), tensor_use_count(received)) == (1, 1)
