"""Run-time compilation of the ``.cu`` sources (cupy/NVRTC) and launches on torch's stream.

Each source in ``kernels/`` is compiled once per device, on its first use, with
:data:`NVRTC_OPTIONS`; kernels are looked up by their ``extern "C"`` names. cupy is imported
inside the functions, so this module imports on machines without it.
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import torch

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
KERNEL_SOURCES = ("quantize.cu", "reorder_quantize.cu", "dequantize.cu", "dequant_reduce.cu")

# [Note: explicit rounding] The wire format forbids FMA contraction, flush-to-zero and
# approximate division; the kernels already use _rn intrinsics for every such operation
# (see wire_math.cuh), and these options make the same true of any other float code.
# Never add --use_fast_math.
NVRTC_OPTIONS = ("-std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")

_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")


def expand_includes(path: Path, seen: set[Path] | None = None) -> str:
    """``path``'s text with every local ``#include "..."`` inlined once (``#pragma once``).

    [Note: kernel cache keys] cupy caches compiled binaries on disk keyed by the source
    text and options, not by the headers that text includes. Inlining the headers makes
    every header edit change the key, so a stale binary can never be loaded.
    """
    seen = set() if seen is None else seen
    seen.add(path)
    lines = []
    for line in path.read_text().splitlines():
        match = _LOCAL_INCLUDE.match(line)
        if match:
            header = (path.parent / match.group(1)).resolve()
            if header not in seen:
                lines.append(expand_includes(header, seen))
        elif not _PRAGMA_ONCE.match(line):
            lines.append(line)
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=None)
def _module(source: str, device_index: int) -> Any:
    import cupy

    with cupy.cuda.Device(device_index):
        return cupy.RawModule(code=expand_includes(KERNEL_DIR / source), options=NVRTC_OPTIONS)


@lru_cache(maxsize=None)
def kernel(source: str, name: str, device_index: int) -> Any:
    """The compiled kernel ``name`` of ``kernels/<source>`` for one device (cached)."""
    import cupy

    with cupy.cuda.Device(device_index):
        return _module(source, device_index).get_function(name)


@lru_cache(maxsize=None)
def multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (``cuda`` without an index means the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def launch(source: str, name: str, device: torch.device, blocks: int, threads: int, args: Sequence[Any]) -> None:
    """Launch kernel ``name`` on ``device`` on torch's current stream for that device.

    [Note: stream ordering] The kernel is enqueued on ``torch.cuda.current_stream(device)``
    through a cupy ExternalStream, so it runs after everything the caller already queued on
    that stream (the producer of the input) and before everything queued after it (the
    collective that sends the payload): the caller's ordering holds with no synchronization,
    exactly as for a torch op. Tensors are passed as raw ``data_ptr()`` addresses; the
    caller keeps them alive, and torch's caching allocator does not reuse their memory for
    other streams' allocations before work queued on this stream has run.
    """
    import cupy

    index = device_index(device)
    function = kernel(source, name, index)
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(index).cuda_stream, index)
    with cupy.cuda.Device(index), stream:
        function((blocks,), (threads,), tuple(args))
