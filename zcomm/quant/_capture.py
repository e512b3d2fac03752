"""Whether the current CUDA stream is capturing a graph, and the error for what cannot be captured.

[Note: capture] Inside a CUDA-graph capture, work is recorded to be replayed later, with
the same addresses and the same host memory: anything made per call on the host and copied
to the device (a pinned table) would be read again on every replay after the host allocator
recycled it, and host synchronizations, subgroup creation and object collectives are not
capturable at all. So zcomm makes such things when a plan is made, outside the capture, keeps
them device-resident in the plan, and raises :class:`CaptureError` when a call under capture
would have to make one (a collective whose plan is not made yet, an interleaved table of
tensors not seen before the capture). Warm up outside the capture with the same tensors,
then capture.
"""

from __future__ import annotations

import torch

_CUDA_BUILT = torch.backends.cuda.is_built()


class CaptureError(RuntimeError):
    """A zcomm call under CUDA-graph capture that would have to do something a capture cannot replay."""


def capturing() -> bool:
    """Whether torch's current CUDA stream is capturing a graph (False in a torch without CUDA)."""
    return _CUDA_BUILT and torch.cuda.is_current_stream_capturing()
