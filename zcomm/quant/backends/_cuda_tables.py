"""The device-resident tables the ``cuda`` backend's kernels read: permutations and address tables.

[Note: device tables] A launch plan ([Note: launch plans] in :mod:`._cuda_launch`) holds what
its kernel reads from device memory besides the call's tensors, made when the launch is
resolved (outside any capture, when a collective's plan is made):

* the permutation of ``reorder_quantize``: uploaded synchronously when the launch is resolved,
  so it is on the device before any call, readable from every stream, and never written or
  freed (one copy per permutation and device, kept for the process). Resolved under capture (a public op first called inside
  a graph), it is uploaded by the graph from a pinned host copy kept for the process, and
  the launch plan is not kept ([Note: capture] in :mod:`zcomm.quant._capture`);
* the interleaved form's table of the tensors' addresses (:class:`HeldTable`). It depends on
  the call's addresses, so it is held per launch plan for the last addresses seen and made
  again when they change, from a pinned host buffer copied on the current stream without a
  host synchronization. Under capture only a held table whose upload was seen complete is
  used (and then kept for the life of the launch plan, since the graph reads it on every
  replay); otherwise the call raises :class:`~zcomm.quant._capture.CaptureError`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import _capture

# pinned host copies of permutations uploaded inside a capture: the graph reads them on every replay
_GRAPH_PERMS: list[torch.Tensor] = []
# (perm, device index) -> its device copy, kept for the process: a launch plan dropped from a cache
# may still have kernels in flight on another stream than the one the copy was allocated on, so
# the copy is never freed (one per distinct permutation: a few per topology)
_DEVICE_PERMS: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}


def device_perm(perm: Sequence[int], device: torch.device) -> torch.Tensor:
    """``perm`` as an int64 tensor on ``device``, uploaded when a launch is resolved ([Note: device tables])."""
    key = (tuple(perm), device.index)
    kept = _DEVICE_PERMS.get(key)
    if kept is not None:
        return kept
    host = torch.tensor(key[0], dtype=torch.int64)
    if _capture.capturing():
        host = host.pin_memory()
        _GRAPH_PERMS.append(host)
        return host.to(device, non_blocking=True)
    kept = _DEVICE_PERMS[key] = host.to(device)
    return kept


def interleaved_table(xs: Sequence[torch.Tensor], parts: int) -> list[int]:
    """InterleavedSource's table (sources.cuh): per tensor its address, its piece of a part, where that
    piece ends; then zeros, which hold the fill's 16-byte-aligned run of 8 (32 bytes) when the table
    starts on a 16-byte boundary, as device allocations do."""
    table, end = [], 0
    for x in xs:
        width = x.numel() // parts
        end += width
        table += [x.data_ptr(), width, end]
    return table + [0] * 5


def _device_table(xs: Sequence[torch.Tensor], parts: int) -> torch.Tensor:
    """The interleaved kernel's table on the tensors' device, uploaded on the current stream.

    [Note: interleaved table] A pinned host tensor from torch's caching host allocator, copied
    with ``non_blocking=True`` (no host synchronization). The allocator records the copy on the
    stream and does not hand the pinned block out again before the copy has run, so dropping
    the host tensor here is safe outside a capture. The device copy is a fresh allocation of
    the caching allocator, so it starts on a 16-byte boundary (the zero run after the entries
    relies on that, see InterleavedSource).
    """
    host = torch.tensor(interleaved_table(xs, parts), dtype=torch.int64).pin_memory()
    return host.to(xs[0].device, non_blocking=True)


class HeldTable:
    """The interleaved table of the last addresses a launch plan saw ([Note: device tables]).

    Reused by a later call on the same addresses and stream (stream order puts the upload
    first); made again, on the current stream, when either changes. The table it replaces was
    allocated and read on its own stream, so the caching allocator hands its block out again
    only in that stream's order. The upload's completion is queried (without blocking) on
    reuse; a capture uses the table only once that was seen, and keeps every table it read as
    long as this object.
    """

    __slots__ = ("addresses", "tensor", "uploaded", "stream", "done", "captured")

    def __init__(self) -> None:
        self.addresses: tuple[int, ...] | None = None
        self.tensor: torch.Tensor | None = None
        self.uploaded: torch.cuda.Event | None = None
        self.stream = 0
        self.done = False
        self.captured: list[torch.Tensor] = []

    def for_tensors(self, xs: Sequence[torch.Tensor], parts: int) -> torch.Tensor:
        """The table of ``xs`` on their device."""
        addresses = tuple(x.data_ptr() for x in xs)
        if _capture.capturing():
            if addresses != self.addresses or not self.done:
                raise _capture.CaptureError(
                    "reorder_quantize of several tensors (a coalesced qgZ bucket, or slices padded to the stages) reads "
                    "a device table of their addresses, which cannot be made under CUDA-graph capture: run the call "
                    "outside the capture on the same tensors first (twice, or with torch.cuda.synchronize() between, "
                    "so the upload is seen complete), then capture")
            if not self.captured or self.captured[-1] is not self.tensor:
                self.captured.append(self.tensor)
            return self.tensor
        stream = torch.cuda.current_stream(xs[0].device).cuda_stream
        if addresses == self.addresses and stream == self.stream:
            if not self.done:
                self.done = self.uploaded.query()
            return self.tensor
        self.tensor = _device_table(xs, parts)
        if self.uploaded is None:  # one event, recorded again after each upload
            self.uploaded = torch.cuda.Event()
        self.uploaded.record()
        self.addresses, self.stream, self.done = addresses, stream, False
        return self.tensor
