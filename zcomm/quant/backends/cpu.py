"""The ``cpu`` backend: fused numba kernels that read and write each byte once.

Every op is a parallel loop over *units*: one quantization group of one output payload
(``quantize``, ``reorder_quantize``, re-quantizing ``dequant_reduce``) or one input group
(``dequantize``, ``dequant_reduce`` to a float dtype). A unit's fp32 values are first
gathered into a small per-thread buffer of ``group_size`` floats, which then stays in L1:

1. *gather*: convert the source elements to fp32 (reading ``reorder_quantize``'s tensors
   through the permutation and the interleaving, one contiguous run at a time, with no
   intermediate copy), or
   decode and sum the ``k`` payloads' elements in row order (``dequant_reduce``);
2. *encode* (:func:`_encode_group`): one integer max over the fp32 bit patterns with the
   sign cleared gives the absmax and the NaN/Inf flags at once (NaN > Inf > every finite
   magnitude as unsigned integers), then the scale, then the codes, packed straight into
   the payload, or *store*: round the fp32 values into the output dtype.

The arithmetic is that of :mod:`zcomm.quant.wire_format`: one fp32 division per group for
the reciprocal of the (pre-scaled) scale, fp32 multiplications by it, round half to even
(``np.rint``), an fp32 multiply to dequantize, no fastmath (no FMA
contraction, no flush-to-zero), and ``error_model="numpy"`` so a division by zero gives
IEEE results instead of raising. Kernels are compiled with ``cache=True`` (spawned worker
processes load them from ``__pycache__`` instead of compiling) and ``nogil=True`` (a
communication thread runs while a kernel does).

[Note: kernel threads] Each kernel launch uses the rank's share of threads
(:func:`zcomm.quant._threads.kernel_threads`), never numba's default of every core. numba's thread
count is a per-Python-thread setting, and the collectives launch their kernels on zcomm's
worker threads, so it is set right before every launch on the launching thread. numba's
``omp`` layer, when it starts its pool, also sets the starting thread's OpenMP thread count
(``omp_set_num_threads``) to the pool size, which is what ``torch.get_num_threads()`` and
torch's own parallel ops on that thread then use: torch's count is put back right after.
(With torch's pip wheels numba's regions in fact run on torch's OpenMP runtime: torch loads its
``libgomp`` globally and numba's ``omppool`` binds its ``GOMP_*`` and ``omp_*`` symbols there, so
numba's regions follow that runtime's settings, its wait policy included: by default its threads
spin-wait for milliseconds before sleeping, which is why small launches run no region at
all: [Note: small serial launches].)

Calls from several Python threads at once need a thread-safe numba
threading layer (``omp``, numba's pick when OpenMP is present, or ``tbb``; ``workqueue``
aborts on concurrent use), and GNU OpenMP is not fork-safe: worker processes must be
spawned, not forked, once a kernel has run.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numba
import numpy as np
import torch
from numba import njit, prange, types
from numba.extending import intrinsic

from .._contract import implements
from .._threads import use_thread_share as _use_thread_share
from ..wire_format import ALIGN, QMAX, SMALLEST_NORMAL_F32, SUBNORMAL_PRESCALE
from ._cpu_float_bits import (
    F32_CANONICAL_NAN_BITS,
    F32_INF_BITS,
    F32_MAGNITUDE_MASK,
    f32_bits,
    f32_from_bits,
    kernel_view,
    load_f32,
    shared_array,
    store_f32,
)

_KERNEL = dict(parallel=True, cache=True, nogil=True, error_model="numpy")
_HELPER = dict(error_model="numpy")
_NEGATIVE_ZERO = np.float32(-0.0)
_INT8_QMAX = QMAX[8]
_INT4_QMAX = QMAX[4]
_ONE = np.float32(1)
_PRESCALE = np.float32(SUBNORMAL_PRESCALE)
_SMALLEST_NORMAL = np.float32(SMALLEST_NORMAL_F32)


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
def _code(value, prescale, reciprocal, limit):
    """``clamp(rint((value * prescale) * reciprocal), -limit, limit)`` in fp32, as an integer."""
    rounded = np.rint((value * prescale) * reciprocal)
    rounded = rounded if rounded < limit else limit
    rounded = rounded if rounded > -limit else -limit
    return np.int64(rounded)


@njit(**_HELPER)
def _pack8(buf, prescale, reciprocal, limit, dst):
    for i in range(dst.size):
        dst[i] = _code(buf[i], prescale, reciprocal, limit)


@njit(**_HELPER)
def _pack4(buf, n, prescale, reciprocal, limit, dst):
    """Element ``2i`` in the low nibble, ``2i + 1`` in the high one; a lone last element
    leaves its high nibble 0."""
    for j in range(n // 2):
        low = _code(buf[2 * j], prescale, reciprocal, limit) & 15
        high = _code(buf[2 * j + 1], prescale, reciprocal, limit) & 15
        dst[j] = low | (high << 4)
    if n % 2:
        dst[n // 2] = _code(buf[n - 1], prescale, reciprocal, limit) & 15


@njit(**_HELPER)
def _encode_group(buf, n, bits, values, start, scales, group):
    """Quantize the group ``buf[:n]`` whose first element is element ``start`` (a multiple
    of the group size, so byte aligned for INT4) of the payload with ``values`` and ``scales``."""
    qmax = _INT8_QMAX if bits == 8 else _INT4_QMAX
    scale = _group_scale(buf, n, qmax)
    scales[group] = scale
    dst = values[start : start + n] if bits == 8 else values[start // 2 : (start + n + 1) // 2]
    if scale == 0 or not np.isfinite(scale):
        # All-zero, NaN and Inf groups carry only their scale; their codes are 0.
        dst[:] = 0
        return
    prescale = _PRESCALE if scale < _SMALLEST_NORMAL else _ONE
    reciprocal = _ONE / (scale * prescale)
    if bits == 8:
        _pack8(buf, prescale, reciprocal, np.float32(qmax), dst)
    else:
        _pack4(buf, n, prescale, reciprocal, np.float32(qmax), dst)


@njit(**_HELPER)
def _nibble(byte, high):
    """The signed 4-bit number in the low (``high == 0``) or high nibble of ``byte``."""
    return (((np.int64(byte) >> (4 * high)) & 15) ^ 8) - 8


@njit(**_HELPER)
def _add_decoded4(values, first, scale, acc):
    """``acc[j] += code(first + j) * scale`` for the INT4 elements of one group: a leading
    odd element, then whole bytes, then a trailing even element."""
    n = acc.size
    j = first % 2
    if j:
        acc[0] += np.float32(_nibble(values[first // 2], 1)) * scale
    pairs = (n - j) // 2
    src = values[(first + j) // 2 : (first + j) // 2 + pairs]
    dst = acc[j : j + 2 * pairs]
    for p in range(pairs):
        dst[2 * p] += np.float32(_nibble(src[p], 0)) * scale
        dst[2 * p + 1] += np.float32(_nibble(src[p], 1)) * scale
    if j + 2 * pairs < n:
        acc[n - 1] += np.float32(_nibble(values[(first + n - 1) // 2], 0)) * scale


@njit(**_HELPER)
def _add_decoded(values, scales, bits, group_size, start, acc):
    """``acc += dequantized elements [start, start + acc.size)`` of one payload, which may
    span several of its groups; a NaN or Inf scale gives NaN."""
    i = start
    while i < start + acc.size:
        group = i // group_size
        stop = min(start + acc.size, (group + 1) * group_size)
        scale = scales[group]
        dst = acc[i - start : stop - start]
        if not np.isfinite(scale):
            dst[:] = f32_from_bits(F32_CANONICAL_NAN_BITS)
        elif bits == 8:
            codes = values[i:stop].view(np.int8)
            for j in range(dst.size):
                dst[j] += np.float32(codes[j]) * scale
        else:
            _add_decoded4(values, i, scale, dst)
        i = stop


@njit(**_HELPER)
def _payload_parts(payload, numel, bits):
    """(codes, scales) views of one payload of ``numel`` elements: the value bytes (int8
    codes or packed INT4 pairs, as uint8) and the fp32 scales behind the padding.

    The offsets are :func:`~zcomm.quant.wire_format.values_nbytes` and
    :func:`~zcomm.quant.wire_format.scales_offset`, restated because numba cannot call them."""
    values_end = numel if bits == 8 else (numel + 1) // 2
    scales_start = (values_end + 3) // 4 * 4
    return payload[:values_end], payload[scales_start:].view(np.float32)


@njit(**_HELPER)
def _sum_rows(payloads, numel, bits, group_size, start, n, divisor, buf):
    """fp32 sum over the payload rows (of ``numel`` elements each) of their elements
    ``[start, start + n)``, divided by ``divisor`` unless it is 1, into ``buf[:n]``.

    [Note: -0 start] The sum starts from -0.0, the exact identity of fp32 addition
    (-0 + x == x bit for bit, -0 + +0 == +0), so the result is d_0 + d_1 + ... as the wire
    format spells it, with no special first row."""
    acc = buf[:n]
    acc[:] = _NEGATIVE_ZERO
    for row in range(payloads.shape[0]):
        values, scales = _payload_parts(payloads[row], numel, bits)
        _add_decoded(values, scales, bits, group_size, start, acc)
    if divisor != 1:
        for i in range(n):
            acc[i] = acc[i] / divisor


@intrinsic
def _pointer(typingctx, address, like):
    """The integer ``address`` as a pointer to elements of the array ``like``'s dtype."""
    if not isinstance(address, types.Integer) or not isinstance(like, types.Array):
        return None
    pointer = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(pointer))

    return pointer(address, like), codegen


@njit(**_HELPER)
def _gather_reordered(like, sources, part_numel, perm, slice_len, start, n, buf):
    """``buf[:n]`` = fp32 elements ``[start, start + n)`` of the reordered interleaved input
    ([Note: interleaved input]), read one contiguous run of one tensor, or of the zero fill, at
    a time. ``sources`` holds per tensor its address, its piece of a part and where that piece
    ends in the part; ``like`` is an array of the tensors' (kernel) dtype."""
    widths, ends = sources[1], sources[2]
    filled = ends[ends.size - 1]
    i = start
    while i < start + n:
        offset = i % slice_len
        element = perm[i // slice_len] * slice_len + offset
        part, position = element // part_numel, element % part_numel
        stop = min(min(start + n, i - offset + slice_len), i + part_numel - position)
        if position >= filled:
            buf[i - start : stop - start] = 0
        else:
            k = np.searchsorted(ends, position, side="right")  # the tensor whose piece holds position
            stop = min(stop, i + ends[k] - position)
            first = part * widths[k] + position - (ends[k] - widths[k])
            segment = numba.carray(_pointer(sources[0][k] + first * like.itemsize, like), stop - i)
            dst = buf[i - start : stop - start]
            for j in range(dst.size):
                dst[j] = load_f32(segment, j)
        i = stop


@njit(**_HELPER)
def _store(buf, n, out, start):
    """``out[start : start + n]`` = ``buf[:n]`` rounded to ``out``'s float format."""
    dst = out[start : start + n]
    for i in range(n):
        store_f32(dst, i, buf[i])


@njit(**_HELPER)
def _unit_count(rows, length, group_size):
    """The work units of ``rows`` rows of ``length`` elements: one per group of each row."""
    return rows * ((length + group_size - 1) // group_size)


@njit(**_HELPER)
def _unit(unit, length, group_size):
    """(row, group, first element in the row, element count) of work unit ``unit``."""
    # prange's index is unsigned; int64 keeps the index arithmetic in signed integers.
    row, group = divmod(np.int64(unit), (length + group_size - 1) // group_size)
    start = group * group_size
    return row, group, start, min(group_size, length - start)


@njit(**_KERNEL)
def _reorder_quantize_kernel(like, sources, part_numel, numel, perm, bits, group_size, payloads):
    """Payload row ``c`` = chunk ``c`` of the reordered interleaved input of ``numel`` elements."""
    chunk = numel // payloads.shape[0]
    slice_len = numel // perm.size
    for unit in prange(_unit_count(payloads.shape[0], chunk, group_size)):
        # [Note: buffer] numba hoists this allocation into the per-thread part of the parallel
        # loop (see its parallel diagnostics): one buffer per thread, reused for its units.
        buf = np.empty(group_size, np.float32)
        c, g, start, n = _unit(unit, chunk, group_size)
        _gather_reordered(like, sources, part_numel, perm, slice_len, c * chunk + start, n, buf)
        values, scales = _payload_parts(payloads[c], chunk, bits)
        _encode_group(buf, n, bits, values, start, scales, g)


@njit(cache=True, nogil=True, error_model="numpy")
def _quantize_small_kernel(like, address, numel, bits, group_size, payload_like, payload_address, nbytes):
    """The payload of ``numel`` elements at ``address`` (of ``like``'s kernel dtype), written to the
    ``nbytes`` bytes at ``payload_address``, padding zeroed: ``quantize`` below
    :data:`_SERIAL_NUMEL`, serial ([Note: small quantize by address])."""
    x = numba.carray(_pointer(address, like), numel)
    payload = numba.carray(_pointer(payload_address, payload_like), nbytes)
    values, scales = _payload_parts(payload, numel, bits)
    payload[values.size : nbytes - 4 * scales.size] = 0
    buf = np.empty(group_size, np.float32)
    for g in range((numel + group_size - 1) // group_size):
        start = g * group_size
        n = min(group_size, numel - start)
        for j in range(n):
            buf[j] = load_f32(x, start + j)
        _encode_group(buf, n, bits, values, start, scales, g)


@njit(cache=True, nogil=True, error_model="numpy")
def _dequantize_small_kernel(payload_like, payload_address, rows, nbytes, bits, group_size, like, address, numel):
    """``dequantize`` of ``rows`` payloads of ``nbytes`` bytes at ``payload_address`` into the
    ``rows * numel`` elements (of ``like``'s kernel dtype) at ``address``, serial ([Note: small
    quantize by address])."""
    payloads = numba.carray(_pointer(payload_address, payload_like), (rows, nbytes))
    out = numba.carray(_pointer(address, like), rows * numel)
    buf = np.empty(group_size, np.float32)
    for r in range(rows):
        for g in range((numel + group_size - 1) // group_size):
            start = g * group_size
            n = min(group_size, numel - start)
            _sum_rows(payloads[r : r + 1], numel, bits, group_size, start, n, np.float32(1), buf)
            _store(buf, n, out, r * numel + start)


@njit(**_KERNEL)
def _dequantize_kernel(payloads, bits, group_size, out):
    """``out[r * numel : (r + 1) * numel]`` = payload row ``r`` dequantized."""
    numel = out.size // payloads.shape[0]
    for unit in prange(_unit_count(payloads.shape[0], numel, group_size)):
        buf = np.empty(group_size, np.float32)
        r, _, start, n = _unit(unit, numel, group_size)
        _sum_rows(payloads[r : r + 1], numel, bits, group_size, start, n, np.float32(1), buf)
        _store(buf, n, out, r * numel + start)


@njit(**_KERNEL)
def _reduce_kernel(payloads, bits, group_size, divisor, out):
    """``out`` = (sum of the payload rows) / divisor, one input group per unit."""
    numel = out.size
    for unit in prange(_unit_count(1, numel, group_size)):
        buf = np.empty(group_size, np.float32)
        _, _, start, n = _unit(unit, numel, group_size)
        _sum_rows(payloads, numel, bits, group_size, start, n, divisor, buf)
        _store(buf, n, out, start)


@njit(**_KERNEL)
def _reduce_requant_kernel(payloads, numel, bits, out_bits, group_size, divisor, requant):
    """Row ``c`` of ``requant`` = chunk ``c`` of (sum of the ``bits`` payload rows) / divisor
    in ``out_bits``, one output group per unit, summed straight into the buffer it is
    quantized from."""
    chunk = numel // requant.shape[0]
    for unit in prange(_unit_count(requant.shape[0], chunk, group_size)):
        buf = np.empty(group_size, np.float32)
        c, g, start, n = _unit(unit, chunk, group_size)
        _sum_rows(payloads, numel, bits, group_size, c * chunk + start, n, divisor, buf)
        values, scales = _payload_parts(requant[c], chunk, out_bits)
        _encode_group(buf, n, out_bits, values, start, scales, g)


def _serial(kernel, name: str):  # noqa: ANN001, ANN202 (numba dispatchers)
    """numba's serial build of the parallel ``kernel`` (its ``prange`` a plain loop): the same arithmetic,
    compiled from a copy of the kernel's Python function named ``name``.

    [Note: serial cache entries] numba's on-disk cache names a function's files by its module,
    qualified name and first line, and keys the builds in them by signature and bytecode, not by
    the compile flags. A serial build of the parallel kernel's own function shared the parallel
    kernel's cache entries: whichever build a process compiled first for a signature was the one
    both dispatchers loaded from then on. The small launches then ran the parallel build (an
    OpenMP region for a few groups' work: with the caller and numba's worker spinning on one
    loaded core, ~7 ms per call instead of 3 us), and large launches could run the serial one.
    The copy under its own name gets its own cache files, so each dispatcher loads its own build."""
    func = kernel.py_func
    copy = type(func)(func.__code__, func.__globals__, name, func.__defaults__, func.__closure__)
    copy.__qualname__ = name
    copy.__doc__ = func.__doc__
    return njit(cache=True, nogil=True, error_model="numpy")(copy)


_reorder_quantize_serial = _serial(_reorder_quantize_kernel, "_reorder_quantize_serial")
_reduce_serial = _serial(_reduce_kernel, "_reduce_serial")
_reduce_requant_serial = _serial(_reduce_requant_kernel, "_reduce_requant_serial")


def _zero_padding(payloads: torch.Tensor, numel: int, bits: int) -> np.ndarray:
    """The ``(rows, nbytes)`` payloads as numpy, with the padding before the scales zeroed."""
    rows = shared_array(payloads)
    values_end = numel if bits == 8 else (numel + 1) // 2  # values_nbytes and scales_offset, inline
    scales_start = (values_end + ALIGN - 1) // ALIGN * ALIGN
    if scales_start != values_end:
        rows[:, values_end:scales_start] = 0
    return rows


# a float dtype -> an empty array of its kernel dtype (``like`` of the reordering kernel)
_LIKE: dict[torch.dtype, np.ndarray] = {}
_NO_PERM = np.zeros(1, np.int64)  # the identity permutation of one slice
# [Note: small serial launches] Below this many elements (written, or read for a reduction) a
# kernel runs numba's serial build of itself ([Note: serial cache entries]): an OpenMP region
# costs more than a few groups' work (its threads spin-wait for each other, and on a loaded
# 2-core machine a thread spinning on the core its partner waits for costs milliseconds per
# region), and the bytes are the same either way.
_SERIAL_NUMEL = 1 << 14


def _like(dtype: torch.dtype) -> np.ndarray:
    like = _LIKE.get(dtype)
    if like is None:
        like = _LIKE[dtype] = kernel_view(torch.empty(0, dtype=dtype))
    return like


def _quantize_into(
    xs: Sequence[torch.Tensor], parts: int, part_numel: int, perm: Sequence[int] | None, bits: int, group_size: int,
    out2d: torch.Tensor,
) -> None:
    """``reorder_quantize`` of the interleaved input of ``xs`` (which the caller keeps alive);
    ``perm`` None is the identity of one slice."""
    numel = parts * part_numel
    payloads = _zero_padding(out2d, numel // out2d.shape[0], bits)
    if len(xs) == 1:
        width = xs[0].numel() // parts
        sources = np.array(((xs[0].data_ptr(),), (width,), (width,)), np.int64)
    else:
        sources = np.empty((3, len(xs)), np.int64)
        end = 0
        for index, x in enumerate(xs):
            width = x.numel() // parts
            end += width
            sources[:, index] = (x.data_ptr(), width, end)
    perm_array = _NO_PERM if perm is None else np.asarray(perm, np.int64)
    if numel < _SERIAL_NUMEL:
        _reorder_quantize_serial(_like(xs[0].dtype), sources, part_numel, numel, perm_array, bits, group_size, payloads)
        return
    _use_thread_share()
    _reorder_quantize_kernel(_like(xs[0].dtype), sources, part_numel, numel, perm_array, bits, group_size, payloads)


@functools.lru_cache(maxsize=64)
def _fp32(divide_by: float) -> np.float32:
    """``divide_by`` rounded to fp32, as the reference's fp32 divisor tensor rounds it."""
    return np.float32(torch.tensor(divide_by, dtype=torch.float32).item())


_BYTES_LIKE = np.empty(0, np.uint8)  # ``like`` of a payload's bytes


@implements("quantize", "cpu")
def quantize(x: torch.Tensor, bits: int, group_size: int, out: torch.Tensor) -> None:
    """The payload of ``x`` in ``out``: by address below :data:`_SERIAL_NUMEL`, else through ``_quantize_into``.

    [Note: small quantize by address] A small payload (the collectives' chunks, single
    parameters) is quantized by the serial kernel from the two tensors' addresses and sizes,
    plain integers: no numpy view of either tensor is built per call (each view and its
    unboxing into numba costs microseconds, as much as the kernel's work at 1K elements).
    The contract guarantees what the views would have checked (contiguous tensors of the
    payload's size, on the CPU), and the caller holds both tensors for the call."""
    numel = x.numel()
    if numel < _SERIAL_NUMEL:
        _quantize_small_kernel(_like(x.dtype), x.data_ptr(), numel, bits, group_size, _BYTES_LIKE, out.data_ptr(),
                               out.numel())
        return
    _quantize_into((x,), 1, numel, None, bits, group_size, out.view(1, -1))


@implements("reorder_quantize", "cpu")
def reorder_quantize(
    xs: list[torch.Tensor],
    parts: int,
    part_numel: int,
    perm: Sequence[int],
    num_chunks: int,
    bits: int,
    group_size: int,
    out: torch.Tensor,
) -> None:
    _quantize_into(xs, parts, part_numel, perm, bits, group_size, out)


@implements("dequantize", "cpu")
def dequantize(payloads: torch.Tensor, numel: int, bits: int, group_size: int, out: torch.Tensor) -> None:
    if numel * payloads.shape[0] < _SERIAL_NUMEL:  # by address ([Note: small quantize by address])
        _dequantize_small_kernel(_BYTES_LIKE, payloads.data_ptr(), payloads.shape[0], payloads.shape[1], bits,
                                 group_size, _like(out.dtype), out.data_ptr(), numel)
        return
    _use_thread_share()
    _dequantize_kernel(shared_array(payloads), bits, group_size, kernel_view(out.detach()))


@implements("dequant_reduce", "cpu")
def dequant_reduce(
    payloads: torch.Tensor, numel: int, bits: int, group_size: int, divide_by: float, out: torch.Tensor
) -> None:
    if numel * payloads.shape[0] < _SERIAL_NUMEL:
        _reduce_serial(shared_array(payloads), bits, group_size, _fp32(divide_by), kernel_view(out.detach()))
        return
    _use_thread_share()
    _reduce_kernel(shared_array(payloads), bits, group_size, _fp32(divide_by), kernel_view(out.detach()))


@implements("dequant_reduce_requant", "cpu")
def dequant_reduce_requant(
    payloads: torch.Tensor, numel: int, bits: int, out_bits: int, group_size: int, divide_by: float, out: torch.Tensor
) -> None:
    requant = _zero_padding(out, numel // out.shape[0], out_bits)
    if numel * payloads.shape[0] < _SERIAL_NUMEL:
        _reduce_requant_serial(shared_array(payloads), numel, bits, out_bits, group_size, _fp32(divide_by), requant)
        return
    _use_thread_share()
    _reduce_requant_kernel(shared_array(payloads), numel, bits, out_bits, group_size, _fp32(divide_by), requant)
