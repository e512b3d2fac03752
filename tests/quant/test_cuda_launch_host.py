"""The cuda backend's per-launch host objects: made once, looked up after.

* ``loader.launch`` builds one cupy ``ExternalStream`` per raw stream handle and device, not
  one per launch (checked on CPU with a stand-in cupy);
* ``loader.current_raw_stream`` (torch's private ``_cuda_getCurrentRawStream``) gives the
  handle of the public ``torch.cuda.current_stream`` (GPU);
* a launch plan's permutation and interleaved table are device-resident; a capture reads a
  table only once its upload was seen complete, else raises (GPU).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from cuda_support import requires_gpu
from zcomm_cuda import loader


def test_one_stream_object_per_raw_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    made, launched = [], []

    class ExternalStream:
        def __init__(self, handle: int, index: int) -> None:
            made.append((handle, index))

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(ExternalStream=ExternalStream))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(loader, "_STREAMS", {})
    monkeypatch.setattr(loader, "_use_driver", False)  # the cupy launcher, whatever $ZCOMM_CUDA_LAUNCHER says
    handles = iter([11, 11, 22, 11])
    monkeypatch.setattr(loader, "current_raw_stream", lambda index: next(handles))
    monkeypatch.setattr(loader, "_current_device", lambda: 0)
    monkeypatch.setattr(loader, "kernel", lambda source, name, index: lambda *args: launched.append(args))
    for _ in range(4):
        loader.launch("quantize.cu", "k", torch.device("cuda", 0), 2, 256, [1, 2])
    assert made == [(11, 0), (22, 0)]
    assert [args[:3] for args in launched] == [((2,), (256,), (1, 2))] * 4
    streams = [args[4] for args in launched]
    assert streams[0] is streams[1] is streams[3] is not streams[2]


@requires_gpu
def test_raw_stream_is_torchs_current_stream() -> None:
    index = torch.cuda.current_device()
    assert loader.current_raw_stream(index) == torch.cuda.current_stream(index).cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert loader.current_raw_stream(index) == side.cuda_stream


@requires_gpu
def test_device_tables_outside_and_inside_a_capture() -> None:
    """A launch plan's permutation is on the device when the plan is made (readable from any
    stream); made inside a capture, it is the graph's. The interleaved table is reused for the
    same addresses and stream, and a capture reads it only once its upload was seen complete
    (else CaptureError), keeping it for replays ([Note: device tables])."""
    from zcomm.quant._capture import CaptureError
    from zcomm.quant.backends._cuda_tables import HeldTable, device_perm, interleaved_table

    device = torch.device("cuda", torch.cuda.current_device())
    perm = device_perm((2, 0, 1), device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert perm.device == device and perm.tolist() == [2, 0, 1]
    xs = [torch.zeros(8, device=device), torch.zeros(16, device=device)]
    held = HeldTable()
    first = held.for_tensors(xs, 2)
    assert held.for_tensors(xs, 2) is first
    torch.cuda.synchronize()
    assert held.for_tensors(xs, 2) is first and held.done
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = device_perm((1, 0), device)
        assert held.for_tensors(xs, 2) is first
        with pytest.raises(CaptureError, match="outside the capture"):
            held.for_tensors(xs[::-1], 2)
    assert held.captured == [first]
    graph.replay()
    torch.cuda.synchronize()
    assert captured.tolist() == [1, 0]
    assert first.tolist()[:6] == interleaved_table(xs, 2)[:6]
