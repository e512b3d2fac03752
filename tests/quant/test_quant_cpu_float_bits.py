"""The ``cpu`` backend's float bit conversions against numpy's and torch's own conversions.

fp16 -> fp32 and bf16 -> fp32 are checked on all 65536 patterns; fp32 -> fp16 and
fp32 -> bf16 on a strided sweep of the 2^32 fp32 patterns plus every rounding boundary
class (ties, overflow thresholds, subnormal edges). NaNs must come out canonical.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from zcomm.quant.backends._cpu_float_bits import kernel_view, load_f32, store_f32


@njit
def _convert(src, dst):
    for i in range(src.size):
        store_f32(dst, i, load_f32(src, i))


def _fp32_sweep() -> np.ndarray:
    """fp32 bit patterns: a prime stride over all 2^32, then values near fp16/bf16 rounding
    boundaries (the 16 and 13 low bits around a half ulp, both signs)."""
    strided = np.arange(0, 1 << 32, 4099, dtype=np.uint64)
    exponents = np.arange(0, 256, dtype=np.uint64) << np.uint64(23)
    near_half = np.array([0x0FFF, 0x1000, 0x1001, 0x2FFF, 0x3000, 0x7FFF, 0x8000, 0x8001, 0x18000], dtype=np.uint64)
    boundaries = (exponents[:, None] | near_half[None, :]).reshape(-1)
    both_signs = np.concatenate([boundaries, boundaries | np.uint64(1 << 31)])
    return np.concatenate([strided, both_signs]).astype(np.uint32)


def _converted(src_tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(src_tensor.numel(), dtype=dtype)
    _convert(kernel_view(src_tensor), kernel_view(out))
    return out


def _with_canonical_nan(expected: torch.Tensor, nan: torch.Tensor, bits: int) -> torch.Tensor:
    expected = expected.clone()
    expected.view(torch.int16 if expected.element_size() == 2 else torch.int32)[nan] = bits
    return expected


def test_16_bit_to_fp32_all_patterns() -> None:
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.float16, torch.bfloat16):
        src = patterns.view(dtype)
        nan = torch.isnan(src)
        expected = _with_canonical_nan(src.to(torch.float32), nan, 0x7FC00000)
        assert torch.equal(_converted(src, torch.float32).view(torch.int32), expected.view(torch.int32)), dtype


def test_fp32_to_16_bit_sweep() -> None:
    src = torch.from_numpy(_fp32_sweep().view(np.float32))
    nan = torch.isnan(src)
    for dtype, nan_bits in ((torch.float16, 0x7E00), (torch.bfloat16, 0x7FC0)):
        expected = _with_canonical_nan(src.to(dtype), nan, nan_bits)
        got = _converted(src, dtype)
        mismatch = (got.view(torch.int16) != expected.view(torch.int16)).nonzero().view(-1)
        assert mismatch.numel() == 0, (dtype, [hex(v) for v in src.view(torch.int32)[mismatch[:5]].tolist()])
