"""The four ops' kernel-contract functions for CUDA tensors (see :mod:`zcomm.quant.ops`).

Each function picks the kernel by dtype and bits, sizes the grid, and launches it on
torch's current stream (:func:`zcomm_cuda.loader.launch`). Arguments arrive validated,
contiguous, non-empty and on one CUDA device; outputs are preallocated.

Grid sizing: the kernels walk their work grid-stride, so the grid is the work size capped
at a few resident blocks per multiprocessor (enough to keep every SM's memory pipeline
busy without launching blocks that would only find no work).
"""

from __future__ import annotations

import numpy as np
import torch

from zcomm.quant.wire_format import num_groups

from . import loader

THREADS = 256
WARPS_PER_BLOCK = THREADS // 32
BLOCKS_PER_SM = 8
RUN = 8  # elements per vector run in the kernels (vector_io.cuh)

_DTYPE_TAG = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

# (device index, perm) -> int64 perm on that device; see [Note: perm lifetime].
_PERMS: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _i64(value: int) -> np.int64:
    return np.int64(value)


def _blocks(device: torch.device, work_blocks: int) -> int:
    return max(1, min(work_blocks, BLOCKS_PER_SM * loader.multiprocessor_count(loader.device_index(device))))


def _encoder_blocks(device: torch.device, jobs: int) -> int:
    """At most one warp per group job (teams of fewer lanes share a warp)."""
    return _blocks(device, -(-jobs // WARPS_PER_BLOCK))


def _decoder_blocks(device: torch.device, runs: int) -> int:
    return _blocks(device, -(-runs // THREADS))


def _check_int32_group_size(group_size: int) -> None:
    if group_size >= 2**31:
        raise ValueError(f"group_size must be < 2**31 for the cuda backend, got {group_size}")


def _device_perm(perm: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``perm`` as an int64 tensor on ``device``, created once per (device, perm).

    [Note: perm lifetime] The cached tensor is never freed, so a kernel still queued on any
    stream can never read memory the allocator has handed out again. Its host-to-device
    copy is synchronized once, at creation, so a later launch on another stream never reads
    it half-written.
    """
    index = loader.device_index(device)
    key = (index, perm)
    if key not in _PERMS:
        tensor = torch.tensor(perm, dtype=torch.int64, device=torch.device("cuda", index))
        torch.cuda.current_stream(index).synchronize()
        _PERMS[key] = tensor
    return _PERMS[key]


def quantize(x: torch.Tensor, bits: int, group_size: int, out: torch.Tensor) -> None:
    _check_int32_group_size(group_size)
    jobs = num_groups(x.numel(), group_size)
    loader.launch(
        "quantize.cu",
        f"zc_quantize_{_DTYPE_TAG[x.dtype]}_int{bits}",
        x.device,
        _encoder_blocks(x.device, jobs),
        THREADS,
        (_ptr(x), _i64(x.numel()), _i64(group_size), _ptr(out)),
    )


def dequantize(payloads: torch.Tensor, numel: int, bits: int, group_size: int, out: torch.Tensor) -> None:
    _check_int32_group_size(group_size)
    rows = payloads.shape[0]
    loader.launch(
        "dequantize.cu",
        f"zc_dequantize_{_DTYPE_TAG[out.dtype]}_int{bits}",
        payloads.device,
        _decoder_blocks(payloads.device, rows * -(-numel // RUN)),
        THREADS,
        (_ptr(payloads), _i64(payloads.shape[1]), _i64(numel), _i64(group_size), _i64(rows), _ptr(out)),
    )


def reorder_quantize(
    x: torch.Tensor, perm: tuple[int, ...], num_chunks: int, bits: int, group_size: int, out: torch.Tensor
) -> None:
    _check_int32_group_size(group_size)
    chunk = x.numel() // num_chunks
    jobs = num_groups(chunk, group_size) * num_chunks
    loader.launch(
        "reorder_quantize.cu",
        f"zc_reorder_quantize_{_DTYPE_TAG[x.dtype]}_int{bits}",
        x.device,
        _encoder_blocks(x.device, jobs),
        THREADS,
        (
            _ptr(x),
            _ptr(_device_perm(perm, x.device)),
            _i64(x.numel() // len(perm)),
            _i64(chunk),
            _i64(num_chunks),
            _i64(group_size),
            _i64(out.shape[1]),
            _ptr(out),
        ),
    )


def dequant_reduce(
    payloads: torch.Tensor,
    numel: int,
    bits: int,
    group_size: int,
    divide_by: float,
    out: torch.Tensor | None,
    requant_out: torch.Tensor | None,
) -> None:
    """Sum (and divide) ``k`` payload rows, then store floats or re-quantize, in one kernel.

    The divisor is rounded to fp32 here (round to nearest even, as the wire format says:
    ``acc / float32(divide_by)``); a Python float would reach the kernel as a double.
    """
    _check_int32_group_size(group_size)
    rows = payloads.shape[0]
    common = (_ptr(payloads), _i64(payloads.shape[1]), _i64(numel), _i64(group_size), _i64(rows))
    divisor = np.float32(divide_by)
    if out is not None:
        name = f"zc_dequant_reduce_{_DTYPE_TAG[out.dtype]}_int{bits}"
        blocks = _decoder_blocks(payloads.device, -(-numel // RUN))
        args = (*common, divisor, _ptr(out))
    else:
        chunks = requant_out.shape[0]
        name = f"zc_dequant_reduce_requant_int{bits}"
        blocks = _encoder_blocks(payloads.device, num_groups(numel // chunks, group_size) * chunks)
        args = (*common, divisor, _i64(chunks), _i64(requant_out.shape[1]), _ptr(requant_out))
    loader.launch("dequant_reduce.cu", name, payloads.device, blocks, THREADS, args)
