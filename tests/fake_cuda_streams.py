"""Stand-ins for ``torch.cuda``'s stream API, its current device and capability, and CUDA
futures on the fake CUDA machine of a CPU build of torch ([Note: fake CUDA streams] in
``fake_cuda``; the capability is an H100's, which torch's ``broadcast`` asks for).

They order nothing: every event is complete, every wait returns at once. What they keep is
the record of what the code asked for (``streams``, a list of strings): streams made and
the devices they were made on, CUDA futures and their devices, ``record_stream`` calls and
the devices of their tensors; a request naming a device other than ``cuda`` fails there,
as it would on a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Iterator
from unittest import mock

import torch


def _cuda(device, what: str) -> torch.device:
    device = torch.device("cuda", 0) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"{what} on {device}: a CUDA stream lives on a CUDA device")
    return device


class _Event:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class _Stream:
    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        self.device = _cuda(device, "torch.cuda.Stream")

    def wait_stream(self, other: _Stream) -> None:
        assert isinstance(other, _Stream), other

    def wait_event(self, event: _Event) -> None:
        assert isinstance(event, _Event), event

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event or _Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


@contextlib.contextmanager
def stand_in_for_cuda_streams(log: list[str]) -> Iterator[None]:
    default = _Stream()
    current = [default]

    def make_stream(device=None, priority: int = 0, **kwargs) -> _Stream:
        stream = _Stream(device, priority)
        log.append(f"stream on {stream.device}")
        return stream

    def current_stream(device=None) -> _Stream:
        _cuda(device, "torch.cuda.current_stream")
        return current[0]

    def set_stream(stream: _Stream) -> None:
        assert isinstance(stream, _Stream), stream
        current[0] = stream

    @contextlib.contextmanager
    def use_stream(stream: _Stream) -> Iterator[None]:
        previous = current[0]
        set_stream(stream)
        try:
            yield
        finally:
            current[0] = previous

    def record_stream(tensor: torch.Tensor, stream: _Stream) -> None:
        assert isinstance(stream, _Stream), stream
        log.append(f"record_stream of a {tensor.device} tensor")

    class Future(torch.futures.Future):
        def __init__(self, *, devices=None) -> None:
            for device in devices or ():
                log.append(f"future on {_cuda(device, 'a CUDA future')}")
            super().__init__()

    patches = [
        mock.patch.multiple(torch.cuda, Stream=make_stream, Event=_Event, current_stream=current_stream,
                            default_stream=lambda device=None: default, set_stream=set_stream, stream=use_stream,
                            current_device=lambda: 0, set_device=lambda device: None,
                            get_device_capability=lambda device=None: (9, 0)),  # torch's broadcast asks
        mock.patch.object(torch.Tensor, "record_stream", record_stream),
        mock.patch.object(torch.futures, "Future", Future),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield
