"""The CUDA chain runner's side streams ([Note: CUDA streams], [Note: side stream per kind]), on CPU.

A CPU build of torch cannot make CUDA streams or events, so ``torch.cuda``'s stream API is
replaced by fakes that log what the runner asks of it, in order; the tensors are stand-ins
with ``is_cuda`` and ``record_stream``. What is checked is the protocol: the side stream is
made once per (device, kind) and reused; each async call makes it wait for the current
stream *before* the chain is enqueued, runs the chain with the side stream current and
restores the caller's stream and current device afterwards (also when the chain raises),
records the end event on the side stream, keeps the call's tensors referenced until that
event has completed (never ``record_stream``: [Note: side-stream buffers by events]), and the
handle's ``wait()`` makes the then current stream wait for that event. Sync calls run the
chain on the current stream.
"""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch

from zcomm import _chain_runner

_ids = itertools.count()


class FakeStream:
    def __init__(self, log: list, name: str, device_index: int = 0) -> None:
        self.log, self.name, self.device_index = log, name, device_index

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    """An event that has completed once ``GPU["done"]`` says so (default: at once)."""

    GPU = {"done": True}

    def __init__(self, log: list) -> None:
        self.log, self.name = log, f"event{next(_ids)}"

    def record(self, stream: FakeStream) -> None:
        self.log.append(("record", self.name, stream.name))

    def query(self) -> bool:
        return self.GPU["done"]


class FakeCudaTensor:
    is_cuda = True

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def record_stream(self, stream: FakeStream) -> None:
        self.log.append(("record_stream", self.name, stream.name))


@pytest.fixture
def cuda_log(monkeypatch):
    """The log of the fake stream API; the current stream is ``main`` until the runner sets another."""
    log: list = []
    state = {"current": FakeStream(log, "main"), "device": 0}
    made = itertools.count()

    def new_stream(device=None):
        log.append(("new_stream", str(device)))
        return FakeStream(log, f"side{next(made)}", torch.device(device).index)

    def set_stream(stream):  # as torch's: the stream's device becomes the current device
        log.append(("set_stream", stream.name))
        state["current"] = stream
        state["device"] = stream.device_index

    def set_device(index):
        log.append(("set_device", index))
        state["device"] = index

    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: state["current"])
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["device"])
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(_chain_runner, "_SIDE_STREAMS", {})
    monkeypatch.setitem(FakeEvent.GPU, "done", True)
    return log


def _chain(log: list, name: str = "chain"):
    return lambda: log.append(("chain", name))


def test_async_call_waits_then_runs_on_the_side_stream_then_restores(cuda_log) -> None:
    device = torch.device("cuda", 0)
    side = _chain_runner.chain_worker(None, None, "gather", device)
    assert isinstance(side, _chain_runner.SideStream)
    tensors = (FakeCudaTensor(cuda_log, "out"), FakeCudaTensor(cuda_log, "in"))
    handle = _chain_runner.run_chain(_chain(cuda_log), tensors, True, side)
    event = next(entry[1] for entry in cuda_log if entry[0] == "record")
    assert cuda_log == [
        ("new_stream", "cuda:0"),
        ("wait_stream", "side0", "main"),
        ("set_stream", "side0"),
        ("chain", "chain"),
        ("record", event, "side0"),
        ("set_stream", "main"),
    ]
    cuda_log.clear()
    handle.wait()
    assert cuda_log == [("wait_event", "main", event)]
    assert handle.is_completed()


def test_side_stream_made_once_per_device_and_kind(cuda_log) -> None:
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    gather = _chain_runner.chain_worker(None, None, "gather", cuda0)
    assert _chain_runner.chain_worker(None, None, "gather", cuda0) is gather
    reduce = _chain_runner.chain_worker(None, None, "reduce", cuda0)
    other = _chain_runner.chain_worker(None, None, "gather", cuda1)
    assert len({id(gather), id(reduce), id(other)}) == 3
    tensors = (FakeCudaTensor(cuda_log, "t"),)
    for _ in range(3):
        _chain_runner.run_chain(_chain(cuda_log), tensors, True, gather)
    _chain_runner.run_chain(_chain(cuda_log), tensors, True, reduce)
    made = [entry for entry in cuda_log if entry[0] == "new_stream"]
    assert made == [("new_stream", "cuda:0"), ("new_stream", "cuda:0")], made  # one per kind, on first use
    waits = [entry for entry in cuda_log if entry[0] == "wait_stream"]
    assert waits == [("wait_stream", "side0", "main")] * 3 + [("wait_stream", "side1", "main")]
    ends = [entry[1] for entry in cuda_log if entry[0] == "record"]
    assert len(set(ends)) == 4, "each call records its own end event"


def test_chain_error_restores_the_callers_stream(cuda_log) -> None:
    side = _chain_runner.chain_worker(None, None, "reduce", torch.device("cuda", 0))

    def failing() -> None:
        raise RuntimeError("kernel launch failed")

    with pytest.raises(RuntimeError, match="kernel launch failed"):
        _chain_runner.run_chain(failing, (FakeCudaTensor(cuda_log, "t"),), True, side)
    assert cuda_log[-1] == ("set_stream", "main")
    assert torch.cuda.current_stream().name == "main"


def test_sync_call_runs_on_the_current_stream(cuda_log) -> None:
    side = _chain_runner.chain_worker(None, None, "gather", torch.device("cuda", 0))
    assert _chain_runner.run_chain(_chain(cuda_log), (FakeCudaTensor(cuda_log, "t"),), False, side) is None
    assert cuda_log == [("chain", "chain")]


def test_side_stream_restores_the_callers_current_device(cuda_log) -> None:
    """[Note: side streams keep the current device]: a chain on cuda:1 issued while cuda:0 is
    current runs with cuda:1 current and leaves cuda:0 current, also when it raises."""
    side = _chain_runner.chain_worker(None, None, "gather", torch.device("cuda", 1))
    seen = []
    _chain_runner.run_chain(lambda: seen.append(torch.cuda.current_device()), (FakeCudaTensor(cuda_log, "t"),),
                            True, side)
    assert seen == [1] and torch.cuda.current_device() == 0
    assert cuda_log[-1] == ("set_device", 0)

    def failing() -> None:
        raise RuntimeError("kernel launch failed")

    with pytest.raises(RuntimeError, match="kernel launch failed"):
        _chain_runner.run_chain(failing, (FakeCudaTensor(cuda_log, "t"),), True, side)
    assert torch.cuda.current_device() == 0
    cuda_log.clear()
    same = _chain_runner.chain_worker(None, None, "gather", torch.device("cuda", 0))
    _chain_runner.run_chain(_chain(cuda_log), (FakeCudaTensor(cuda_log, "t"),), True, same)
    assert not [entry for entry in cuda_log if entry[0] == "set_device"], "no device switch when it is current"


def test_tensors_held_until_the_end_event_completed(cuda_log, monkeypatch) -> None:
    """[Note: side-stream buffers by events]: the call's tensors stay referenced while its end
    event has not completed, however the caller drops them, and are let go by the first later
    call or ``wait()`` that finds it completed; nothing is ``record_stream``-ed."""
    side = _chain_runner.chain_worker(None, None, "gather", torch.device("cuda", 0))
    monkeypatch.setitem(FakeEvent.GPU, "done", False)
    first = FakeCudaTensor(cuda_log, "first")
    held = weakref.ref(first)
    handle = _chain_runner.run_chain(_chain(cuda_log), (first,), True, side)
    del first
    gc.collect()
    assert held() is not None, "dropped by the caller while its chain may still run: kept"
    handle.wait()
    gc.collect()
    assert held() is not None, "wait() only enqueues the wait: the chain may still run"
    second = _chain_runner.run_chain(_chain(cuda_log), (FakeCudaTensor(cuda_log, "second"),), True, side)
    gc.collect()
    assert held() is not None
    monkeypatch.setitem(FakeEvent.GPU, "done", True)
    second.wait()
    gc.collect()
    assert held() is None and not side._pending, "both chains ended: their tensors are let go"
    assert not [entry for entry in cuda_log if entry[0] == "record_stream"]
