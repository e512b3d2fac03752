"""The ``cpu`` backend: fused numba kernels that read and write each byte once.

Every op is a parallel loop over *units*: one quantization group of one output payload
(``quantize``, ``reorder_quantize``, re-quantizing ``dequant_reduce``) or one input group
(``dequantize``, ``dequant_reduce`` to a float dtype). A unit's fp32 values are first
gathered into a small per-thread buffer of ``group_size`` floats, which then stays in L1:

1. *gather*: convert the source elements to fp32 (reading ``reorder_quantize``'s input
   through the permutation, slice segment by slice segment, with no intermediate copy), or
   decode and sum the ``k`` payloads' elements in row order (``dequant_reduce``);
2. *encode* (:func:`_encode_group`): one integer max over the fp32 bit patterns with the
   sign cleared gives the absmax and the NaN/Inf flags at once (NaN > Inf > every finite
   magnitude as unsigned integers), then the scale, then the codes, packed straight into
   the payload, or *store*: round the fp32 values into the output dtype.

The arithmetic is that of :mod:`zcomm.quant.wire_format`: fp32 division by the scale,
round half to even (``np.rint``), an fp32 multiply to dequantize, no fastmath (no FMA
contraction, no flush-to-zero), and ``error_model="numpy"`` so a division by zero gives
IEEE results instead of raising. Kernels are compiled with ``cache=True`` (spawned worker
processes load them from ``__pycache__`` instead of compiling) and ``nogil=True`` (a
communication thread runs while a kernel does).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from ..registry import register
from ..wire_format import QMAX, scales_offset, values_nbytes
from .cpu_float_bits import (
    F32_CANONICAL_NAN_BITS,
    F32_INF_BITS,
    F32_MAGNITUDE_MASK,
    f32_bits,
    f32_from_bits,
    kernel_view,
    load_f32,
    store_f32,
)

_KERNEL = dict(parallel=True, cache=True, nogil=True, error_model="numpy")
_HELPER = dict(error_model="numpy")
_NEGATIVE_ZERO = np.float32(-0.0)
_INT8_QMAX = QMAX[8]
_INT4_QMAX = QMAX[4]


@njit(**_HELPER)
def _group_scale(buf, n, qmax):
    """The scale of ``buf[:n]``: canonical NaN, +Inf, or the fp32 division ``absmax / qmax``."""
    magnitude = 0
    for i in range(n):
        magnitude = max(magnitude, np.int64(f32_bits(buf[i])) & F32_MAGNITUDE_MASK)
    if magnitude > F32_INF_BITS:
        return f32_from_bits(F32_CANONICAL_NAN_BITS)
    return f32_from_bits(magnitude) / np.float32(qmax)


@njit(**_HELPER)
def _code(value, scale, limit):
    """``clamp(rint(value / scale), -limit, limit)`` in fp32, as an integer."""
    rounded = np.rint(value / scale)
    rounded = rounded if rounded < limit else limit
    rounded = rounded if rounded > -limit else -limit
    return np.int64(rounded)


@njit(**_HELPER)
def _pack8(buf, n, scale, limit, values, start):
    for i in range(n):
        values[start + i] = _code(buf[i], scale, limit)


@njit(**_HELPER)
def _pack4(buf, n, scale, limit, values, start):
    """Element ``2i`` in the low nibble, ``2i + 1`` in the high one; a lone last element
    leaves its high nibble 0."""
    first_byte = start // 2
    for j in range(n // 2):
        low = _code(buf[2 * j], scale, limit) & 15
        high = _code(buf[2 * j + 1], scale, limit) & 15
        values[first_byte + j] = low | (high << 4)
    if n % 2:
        values[first_byte + n // 2] = _code(buf[n - 1], scale, limit) & 15


@njit(**_HELPER)
def _encode_group(buf, n, bits, values, start, scales, group):
    """Quantize the group ``buf[:n]`` whose first element is element ``start`` of the payload
    with ``values`` (int8 or packed uint8) and fp32 ``scales``."""
    qmax = _INT8_QMAX if bits == 8 else _INT4_QMAX
    scale = _group_scale(buf, n, qmax)
    scales[group] = scale
    if scale == 0 or not np.isfinite(scale):
        # All-zero, NaN and Inf groups carry only their scale; their codes are 0.
        first_byte = start if bits == 8 else start // 2
        values[first_byte : first_byte + (n if bits == 8 else (n + 1) // 2)] = 0
        return
    limit = np.float32(qmax)
    if bits == 8:
        _pack8(buf, n, scale, limit, values, start)
    else:
        _pack4(buf, n, scale, limit, values, start)


@njit(**_HELPER)
def _nibble(byte, high):
    """The signed 4-bit number in the low (``high == 0``) or high nibble of ``byte``."""
    return (((np.int64(byte) >> (4 * high)) & 15) ^ 8) - 8


@njit(**_HELPER)
def _add_decoded4(values, start, stop, scale, buf, base):
    """``buf[j - base] += code_j * scale`` for INT4 elements ``start <= j < stop``: a leading
    odd element, then whole bytes, then a trailing even element."""
    j = start
    if j % 2 and j < stop:
        buf[j - base] += np.float32(_nibble(values[j // 2], 1)) * scale
        j += 1
    for p in range((stop - j) // 2):
        byte = values[j // 2 + p]
        buf[j - base + 2 * p] += np.float32(_nibble(byte, 0)) * scale
        buf[j - base + 2 * p + 1] += np.float32(_nibble(byte, 1)) * scale
    j += (stop - j) // 2 * 2
    if j < stop:
        buf[j - base] += np.float32(_nibble(values[j // 2], 0)) * scale


@njit(**_HELPER)
def _add_decoded(values, scales, bits, group_size, start, n, buf):
    """``buf[:n] += dequantized elements [start, start + n)`` of one payload, which may span
    several of its groups; a NaN or Inf scale gives NaN."""
    i = start
    while i < start + n:
        group = i // group_size
        stop = min(start + n, (group + 1) * group_size)
        scale = scales[group]
        if not np.isfinite(scale):
            buf[i - start : stop - start] = f32_from_bits(F32_CANONICAL_NAN_BITS)
        elif bits == 8:
            for j in range(i, stop):
                buf[j - start] += np.float32(values[j]) * scale
        else:
            _add_decoded4(values, i, stop, scale, buf, start)
        i = stop


@njit(**_HELPER)
def _sum_rows(values2d, scales2d, bits, group_size, start, n, divisor, buf):
    """fp32 sum over the payload rows of elements ``[start, start + n)``, divided by
    ``divisor`` unless it is 1, into ``buf[:n]``.

    [Note: -0 start] The sum starts from -0.0, the exact identity of fp32 addition
    (-0 + x == x bit for bit, -0 + +0 == +0), so the result is d_0 + d_1 + ... as the wire
    format spells it, with no special first row."""
    buf[:n] = _NEGATIVE_ZERO
    for row in range(values2d.shape[0]):
        _add_decoded(values2d[row], scales2d[row], bits, group_size, start, n, buf)
    if divisor != 1:
        for i in range(n):
            buf[i] = buf[i] / divisor


@njit(**_HELPER)
def _gather_reordered(src, perm, start, n, buf):
    """``buf[:n]`` = fp32 elements ``[start, start + n)`` of the reordered input, whose slice
    ``p`` is ``src``'s slice ``perm[p]``, read one contiguous segment at a time."""
    slice_len = src.size // perm.size
    i = start
    while i < start + n:
        offset = i % slice_len
        stop = min(start + n, i - offset + slice_len)
        source = perm[i // slice_len] * slice_len + offset
        for j in range(stop - i):
            buf[i - start + j] = load_f32(src, source + j)
        i = stop


@njit(**_KERNEL)
def _reorder_quantize_kernel(src, perm, bits, group_size, values2d, scales2d):
    """Payload ``c`` of ``values2d``/``scales2d`` = chunk ``c`` of the reordered ``src``."""
    chunks, groups = scales2d.shape
    chunk = src.size // chunks
    for unit in prange(chunks * groups):
        # [Note: buffer] numba hoists this allocation out of the loop: one buffer per thread.
        # prange's index is unsigned; int64 keeps the index arithmetic in signed integers.
        buf = np.empty(group_size, np.float32)
        c, g = divmod(np.int64(unit), groups)
        n = min(group_size, chunk - g * group_size)
        _gather_reordered(src, perm, c * chunk + g * group_size, n, buf)
        _encode_group(buf, n, bits, values2d[c], g * group_size, scales2d[c], g)


@njit(**_KERNEL)
def _dequantize_kernel(values2d, scales2d, bits, group_size, out):
    """``out[r * numel : (r + 1) * numel]`` = payload ``r`` dequantized."""
    rows, groups = scales2d.shape
    numel = out.size // rows
    for unit in prange(rows * groups):
        buf = np.empty(group_size, np.float32)
        r, g = divmod(np.int64(unit), groups)
        start = g * group_size
        n = min(group_size, numel - start)
        _sum_rows(values2d[r : r + 1], scales2d[r : r + 1], bits, group_size, start, n, np.float32(1), buf)
        for i in range(n):
            store_f32(out, r * numel + start + i, buf[i])


@njit(**_KERNEL)
def _reduce_kernel(values2d, scales2d, bits, group_size, divisor, out):
    """``out`` = (sum of the payloads) / divisor, one input group per unit."""
    groups = scales2d.shape[1]
    for g in prange(groups):
        buf = np.empty(group_size, np.float32)
        start = np.int64(g) * group_size
        n = min(group_size, out.size - start)
        _sum_rows(values2d, scales2d, bits, group_size, start, n, divisor, buf)
        for i in range(n):
            store_f32(out, start + i, buf[i])


@njit(**_KERNEL)
def _reduce_requant_kernel(values2d, scales2d, numel, bits, group_size, divisor, out_values2d, out_scales2d):
    """Payload ``c`` of ``out_*`` = chunk ``c`` of (sum of the payloads) / divisor, one output
    group per unit, summed straight into the buffer it is quantized from."""
    chunks, groups = out_scales2d.shape
    chunk = numel // chunks
    for unit in prange(chunks * groups):
        buf = np.empty(group_size, np.float32)
        c, g = divmod(np.int64(unit), groups)
        n = min(group_size, chunk - g * group_size)
        _sum_rows(values2d, scales2d, bits, group_size, c * chunk + g * group_size, n, divisor, buf)
        _encode_group(buf, n, bits, out_values2d[c], g * group_size, out_scales2d[c], g)


def _payload_views(payloads: torch.Tensor, numel: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, scales) numpy views of the ``(rows, nbytes)`` payloads: int8 codes or packed
    INT4 bytes, and the fp32 scales (rows are 4-byte multiples, so the scales stay aligned)."""
    rows = payloads.numpy()
    values = rows[:, : values_nbytes(numel, bits)]
    scales = rows[:, scales_offset(numel, bits) :].view(np.float32)
    return (values.view(np.int8) if bits == 8 else values), scales


def _quantize_into(x: torch.Tensor, perm: tuple[int, ...], bits: int, group_size: int, out2d: torch.Tensor) -> None:
    chunk = x.numel() // out2d.shape[0]
    out2d.numpy()[:, values_nbytes(chunk, bits) : scales_offset(chunk, bits)] = 0
    values, scales = _payload_views(out2d, chunk, bits)
    _reorder_quantize_kernel(kernel_view(x.detach()), np.asarray(perm, np.int64), bits, group_size, values, scales)


@register("quantize", "cpu")
def quantize(x: torch.Tensor, bits: int, group_size: int, out: torch.Tensor) -> None:
    _quantize_into(x, (0,), bits, group_size, out.view(1, -1))


@register("reorder_quantize", "cpu")
def reorder_quantize(
    x: torch.Tensor, perm: tuple[int, ...], num_chunks: int, bits: int, group_size: int, out: torch.Tensor
) -> None:
    _quantize_into(x, perm, bits, group_size, out)


@register("dequantize", "cpu")
def dequantize(payloads: torch.Tensor, numel: int, bits: int, group_size: int, out: torch.Tensor) -> None:
    values, scales = _payload_views(payloads, numel, bits)
    _dequantize_kernel(values, scales, bits, group_size, kernel_view(out.detach()))


@register("dequant_reduce", "cpu")
def dequant_reduce(
    payloads: torch.Tensor,
    numel: int,
    bits: int,
    group_size: int,
    divide_by: float,
    out: torch.Tensor | None,
    requant_out: torch.Tensor | None,
) -> None:
    values, scales = _payload_views(payloads, numel, bits)
    # The same fp32 rounding of divide_by as the reference's torch.tensor(divide_by, float32).
    divisor = np.float32(torch.tensor(divide_by, dtype=torch.float32).item())
    if out is not None:
        _reduce_kernel(values, scales, bits, group_size, divisor, kernel_view(out.detach()))
        return
    chunk = numel // requant_out.shape[0]
    requant_out.numpy()[:, values_nbytes(chunk, bits) : scales_offset(chunk, bits)] = 0
    out_values, out_scales = _payload_views(requant_out, chunk, bits)
    _reduce_requant_kernel(values, scales, numel, bits, group_size, divisor, out_values, out_scales)
