"""Float bit conversions for the numba ``cpu`` backend: bf16 / fp16 <-> fp32, exactly as torch.

numba has no bf16 and no CPU fp16 arithmetic, so 16-bit tensors reach the kernels as their
bit patterns and are converted here with integer and fp32 operations only:

* **bf16 -> fp32** is exact: the 16 bits become the high half of the fp32 bits.
* **fp16 -> fp32** is exact: the exponent is rebiased by an integer add and a multiply by
  2^-112, and subnormals are rebuilt as ``(0.5 + m * 2^-24) - 0.5`` (the classic branch-free
  construction of Maratyszcza's FP16 library).
* **fp32 -> bf16** rounds to nearest even by adding ``0x7FFF + lsb`` to the bits and keeping
  the high half; the carry handles overflow to Inf and subnormals need no special case
  because bf16 shares fp32's exponent range.
* **fp32 -> fp16** lets the fp32 adder do the rounding: ``|x|`` is scaled so that values too
  large for fp16 become Inf, then a power of two is added whose ulp equals the fp16 ulp of
  ``x`` (at least the subnormal ulp 2^-24), so round-to-nearest-even of that addition is the
  fp16 rounding; the fp16 exponent and mantissa are then read out of the sum's bits.
* Every NaN becomes the canonical NaN of the target type (fp32 0x7FC00000, bf16 0x7FC0,
  fp16 0x7E00), as the wire format requires.

Which 16-bit format an array holds is told by its numpy dtype (see :func:`kernel_view`):
bf16 travels as ``int16`` (torch's own ``view(torch.int16)``), fp16 as ``uint16``.
:func:`load_f32` and :func:`store_f32` dispatch on that dtype at compile time, so each
kernel is specialized per input/output dtype with no per-element branching on the format.

[Note: numba cache] numba's on-disk cache is keyed on the file of the cached kernel only
(``cpu.py``); after editing this file, delete ``zcomm/quant/backends/__pycache__/cpu.*.nb*``
so the kernels are recompiled with the new helpers.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

F32_CANONICAL_NAN_BITS = 0x7FC00000
BF16_CANONICAL_NAN_BITS = 0x7FC0
F16_CANONICAL_NAN_BITS = 0x7E00
F32_INF_BITS = 0x7F800000
F32_MAGNITUDE_MASK = 0x7FFFFFFF

# The numpy dtype each torch dtype is handed to the kernels as (see the module docstring).
_KERNEL_DTYPE = {torch.float32: torch.float32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# Payloads (uint8) and kernel views (see _KERNEL_DTYPE) as numpy dtypes.
_NUMPY_DTYPE = {
    torch.uint8: np.dtype(np.uint8), torch.int16: np.dtype(np.int16), torch.float32: np.dtype(np.float32)
}


class _Memory:
    """What ``numpy.asarray`` reads an array's memory from: the ``__array_interface__`` protocol."""

    __slots__ = ("__array_interface__",)


def shared_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy array over the memory of the contiguous CPU ``tensor``, made without ``Tensor.numpy()``.

    [Note: resizable storage] ``Tensor.numpy()`` marks the tensor's storage non-resizable for
    good (so numpy can never hold a dangling pointer). That breaks callers that free a buffer
    between uses by resizing its storage to zero, as ZeRO-3 and FSDP do with the parameter
    buffer they hand to ``all_gather_q8`` as ``output``. The kernels use the array only during
    the call, while the caller holds ``tensor``, so a view over its data pointer is safe here.
    The view is made through the array interface protocol (address, shape, type string):
    one ``numpy.asarray``, no ctypes pointer objects, which keeps a kernel launch's host cost low.
    """
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    dtype = _NUMPY_DTYPE[tensor.dtype]
    if tensor.numel() == 0:
        return np.empty(tuple(tensor.shape), dtype)
    memory = _Memory()
    memory.__array_interface__ = {
        "data": (tensor.data_ptr(), False), "shape": tuple(tensor.shape), "typestr": dtype.str, "version": 3
    }
    return np.asarray(memory)


def kernel_view(tensor: torch.Tensor) -> np.ndarray:
    """The numpy array a kernel reads or writes for a float ``tensor`` (shares memory)."""
    array = shared_array(tensor.view(_KERNEL_DTYPE[tensor.dtype]))
    return array.view(np.uint16) if tensor.dtype == torch.float16 else array


@intrinsic
def f32_from_bits(typingctx, bits):
    """The fp32 whose bit pattern is the low 32 bits of the integer ``bits``."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def f32_bits(typingctx, value):
    """The bit pattern of the fp32 ``value`` as a ``uint32``."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(value), codegen


_TWO_POW_MINUS_112 = np.float32(2.0**-112)
_TWO_POW_PLUS_112 = np.float32(2.0**112)
_TWO_POW_MINUS_110 = np.float32(2.0**-110)
_HALF = np.float32(0.5)


@njit
def bf16_to_f32(bits: int) -> np.float32:
    return f32_from_bits((np.int64(bits) & 0xFFFF) << 16)


@njit
def f16_to_f32(bits: int) -> np.float32:
    """Exact fp16 -> fp32: normals (and Inf/NaN) by rebiasing, subnormals by a subtraction."""
    half = np.int64(bits) & 0xFFFF
    magnitude = half & 0x7FFF
    sign = (half & 0x8000) << 16
    if magnitude < 0x400:
        value = f32_from_bits(magnitude | (126 << 23)) - _HALF
    else:
        value = f32_from_bits((magnitude << 13) + (0xE0 << 23)) * _TWO_POW_MINUS_112
    return f32_from_bits(np.int64(f32_bits(value)) | sign)


@njit
def f32_to_bf16(value: np.float32) -> int:
    bits = np.int64(f32_bits(value))
    if bits & F32_MAGNITUDE_MASK > F32_INF_BITS:
        return BF16_CANONICAL_NAN_BITS
    return (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16


@njit
def f32_to_f16(value: np.float32) -> int:
    """fp32 -> fp16 with round-to-nearest-even done by one fp32 addition (module docstring)."""
    bits = np.int64(f32_bits(value))
    magnitude = bits & F32_MAGNITUDE_MASK
    if magnitude > F32_INF_BITS:
        return F16_CANONICAL_NAN_BITS
    base = (abs(value) * _TWO_POW_PLUS_112) * _TWO_POW_MINUS_110
    exponent = max(magnitude & F32_INF_BITS, 0x38800000)
    rounded = np.int64(f32_bits(f32_from_bits(exponent + 0x07800000) + base))
    return ((bits >> 16) & 0x8000) | (((rounded >> 13) & 0x7C00) + (rounded & 0x0FFF))


@njit
def canonical_f32(value: np.float32) -> np.float32:
    if np.isnan(value):
        return f32_from_bits(F32_CANONICAL_NAN_BITS)
    return value


def load_f32(array, index):
    """``array[index]`` as fp32 (numba only; dispatches on the array dtype)."""
    raise NotImplementedError("load_f32 is only callable from numba-compiled code")


def store_f32(array, index, value):
    """``array[index] = value`` rounded to the array's float format (numba only)."""
    raise NotImplementedError("store_f32 is only callable from numba-compiled code")


@overload(load_f32)
def _load_f32(array, index):
    if array.dtype == types.float32:
        return lambda array, index: array[index]
    if array.dtype == types.int16:
        return lambda array, index: bf16_to_f32(array[index])
    if array.dtype == types.uint16:
        return lambda array, index: f16_to_f32(array[index])
    return None


@overload(store_f32)
def _store_f32(array, index, value):
    if array.dtype == types.float32:

        def store(array, index, value):
            array[index] = canonical_f32(value)

        return store
    if array.dtype == types.int16:

        def store(array, index, value):
            array[index] = np.int16(np.uint16(f32_to_bf16(value)))

        return store
    if array.dtype == types.uint16:

        def store(array, index, value):
            array[index] = np.uint16(f32_to_f16(value))

        return store
    return None
