"""The cuda backend's per-launch host objects: made once, looked up after.

* ``loader.launch`` builds one cupy ``ExternalStream`` per raw stream handle and device, not
  one per launch (checked on CPU with a stand-in cupy);
* ``loader.current_raw_stream`` (torch's private ``_cuda_getCurrentRawStream``) gives the
  handle of the public ``torch.cuda.current_stream`` (GPU);
* the permutation reaches the device once per (perm, device) in eager calls; first seen
  inside a CUDA graph capture it is uploaded by the graph and not cached (GPU).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from cuda_support import requires_gpu
from zcomm.quant.backends import _cuda_launch as cuda_launch
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
def test_permutation_uploaded_once_outside_a_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager: one device copy per (perm, device), the same tensor on every later call, also on
    another stream. First seen inside a capture: a graph-owned copy, not cached."""
    monkeypatch.setattr(cuda_launch, "_DEVICE_PERMS", {})
    device = torch.device("cuda", torch.cuda.current_device())
    first = cuda_launch._device_perm((2, 0, 1), device)
    assert first.device == device and first.tolist() == [2, 0, 1]
    assert cuda_launch._device_perm([2, 0, 1], device) is first
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert cuda_launch._device_perm((2, 0, 1), device) is first
    torch.cuda.synchronize()
    assert cuda_launch._device_perm((2, 0, 1), device) is first  # the warm-up call sees the upload done
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = cuda_launch._device_perm((1, 0), device)
        assert cuda_launch._device_perm((2, 0, 1), device) is first  # seen complete: read directly
    assert ((1, 0), device.index) not in cuda_launch._DEVICE_PERMS
    graph.replay()
    torch.cuda.synchronize()
    assert captured.tolist() == [1, 0]
