"""The decoders' fp32 -> fp16 and fp32 -> bf16 rounding ([Note: hardware narrowing] in
wire_math.cuh): the software path the host check runs (the kernels' ``__host__ __device__``
code compiled by nvcc for the CPU, tests/quant/host_check_server.py) against IEEE oracles on
every class of fp32 input, and the CUDA decoders' hardware rounding against the same oracles.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import host_check_server
import zcomm.quant as zq
from cuda_support import requires_gpu, requires_nvcc
from host_check_server import HostCheck

pytestmark = requires_nvcc
# the conftest starts this module's host_check build in the background ([Note: background builds])
builds_of = host_check_server.builds_of


# ---- The decoders' fp32 -> fp16 rounding ([Note: hardware narrowing] in wire_math.cuh) ----
# The device rounds with cvt.rn.f16x2.f32, whose result for every fp32 that is not a NaN is the
# IEEE 754 round-to-nearest-even one; the host check runs the software path (f16x2_bits on the
# host). These tests prove the software path IEEE against an independent oracle, numpy's
# astype(float16), on every class of fp32 input (both signs: zeros, fp32 subnormals, values
# that round to zero or to the smallest fp16 subnormal, fp16 subnormal results, the smallest
# normal, exact halfway cases at every rounding position, the largest finite 65504, the
# overflow threshold 65520, Inf, quiet and signaling NaNs with payloads), so that host and
# device agree by the IEEE definition. NaN becomes the wire format's canonical fp16 NaN.

F16_CANONICAL_NAN = zq.wire_format.CANONICAL_NAN_BITS[torch.float16]
EXHAUSTIVE_VARIABLE = "ZCOMM_FP16_EXHAUSTIVE"


def _ieee_f16(bits: np.ndarray) -> np.ndarray:
    """numpy's IEEE round-to-nearest-even of fp32 bit patterns, NaN made the canonical NaN."""
    values = bits.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        rounded = values.astype(np.float16)
    assert np.array_equal(np.isnan(rounded), np.isnan(values))  # the oracle keeps NaNs NaN
    return np.where(np.isnan(values), np.uint16(F16_CANONICAL_NAN), rounded.view(np.uint16))


def _check_narrowed(out: Path, bits: np.ndarray, op: str = "narrow") -> None:
    """The 16-bit words the host check's `op` wrote to `out` against the IEEE oracle of its type."""
    got = np.fromfile(out, dtype=np.uint16)
    expected = (_ieee_f16 if op == "narrow" else _ieee_bf16)(bits)
    bad = np.flatnonzero(got != expected)
    assert got.size == bits.size and bad.size == 0, [
        (hex(bits[i]), hex(got[i]), hex(expected[i])) for i in bad[:8]
    ]


def _dense_patterns() -> np.ndarray:
    """Every sign and exponent with 2048 x 10 mantissas: bits 12-22 take every value (every
    fp16 mantissa and the bit below it, and for fp16 subnormal results every rounding position
    above bit 12), bits 0-11 one of ten patterns (0: exact ties where bit 12 or a higher bit
    is the half; 1, 0x7FF, 0x800, 0xFFF: just above and below them, and ties at bit 11)."""
    lows = np.array([0, 1, 2, 0x3FF, 0x555, 0x7FF, 0x800, 0x801, 0xFFE, 0xFFF], dtype=np.uint32)
    mantissas = ((np.arange(2048, dtype=np.uint32) << 12)[:, None] | lows[None, :]).ravel()
    exponents = np.arange(256, dtype=np.uint32) << 23
    signs = np.array([0, 1 << 31], dtype=np.uint32)
    return (signs[:, None, None] | exponents[None, :, None] | mantissas[None, None, :]).ravel()


def test_fp16_rounding_dense_sweep(host_check):
    bits = _dense_patterns()
    special = np.array([0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0x33000000, 0x33000001,
                        0x387FC000, 0x387FE000, 0x387FFFFF, 0x38800000, 0x7F800001, 0x7FBFFFFF, 0x7FC00000,
                        0x7FFFFFFF, 0x00000001, 0x007FFFFF], dtype=np.uint32)
    bits = np.concatenate([bits, special, special | np.uint32(1 << 31)])
    _check_patterns(host_check, bits)


def _check_patterns(host_check: HostCheck, bits: np.ndarray, op: str = "narrow") -> None:
    """The host check's narrowing `op` ("narrow": fp16, "narrow_bf16") of the fp32 patterns `bits`."""
    src, dst = host_check.scratch / "in.bin", host_check.scratch / "out.bin"
    bits.tofile(src)
    dst.unlink(missing_ok=True)
    host_check.run(op, src, dst)
    _check_narrowed(dst, bits, op)


def _check_range(host_check: HostCheck, first: int, count: int, op: str = "narrow") -> None:
    """As _check_patterns, for the `count` patterns from `first`, made by the host check itself."""
    out = host_check.scratch / "out.bin"
    out.unlink(missing_ok=True)
    host_check.run(op, first, count, out)
    _check_narrowed(out, np.arange(first, first + count, dtype=np.uint32), op)


# Every pattern of the fp32 binades where the rounding changes kind: [2^-25, 2^-24) (2^-25
# ties to 0, above it to the smallest subnormal), [2^-15, 2^-14) (subnormal results, the top
# rounding up to the smallest normal), [2^-14, 2^-13) (the smallest normal binade),
# [2^15, 2^16) (65504 the largest finite, 65520 and above to Inf), and Inf and every NaN.
@pytest.mark.parametrize("sign", (0, 1))
@pytest.mark.parametrize("exponent", (102, 112, 113, 142, 255))
def test_fp16_rounding_exhaustive_binades(host_check, exponent, sign):
    _check_range(host_check, (sign << 31) | (exponent << 23), 1 << 23)


@pytest.mark.skipif(os.environ.get(EXHAUSTIVE_VARIABLE) != "1",
                    reason=f"all 2**32 fp32 patterns take minutes: set {EXHAUSTIVE_VARIABLE}=1")
def test_fp16_rounding_every_fp32(host_check):
    chunk = 1 << 26
    for first in range(0, 1 << 32, chunk):
        _check_range(host_check, first, chunk)


# ---- The decoders' fp32 -> bf16 rounding ([Note: hardware narrowing] in wire_math.cuh) ----
# From sm_80 the device rounds with cvt.rn.bf16x2.f32 plus a NaN fix-up (set.nan.u32.bf16x2
# from sm_90, the integer test of [Note: bf16 NaN halves] before); the host and older devices
# run the software path (bf16x2_bits on the host). These tests prove the software path IEEE
# round-to-nearest-even against torch's float32 -> bfloat16 conversion, itself checked on
# every input against an independent rule (the nearer of the two neighbouring bf16 values,
# computed exactly in fp64, the even one on a tie, Inf counted as 2^128 as IEEE's overflow
# rule does). The sweep covers every class of fp32 input with both signs: zeros, fp32
# subnormals (bf16 has fp32's exponent range, so they round on bf16's subnormal grid, the top
# of it up to the smallest normal), exact halfway cases with the kept value even and odd,
# just below and above them, every binade's top rounding to the next power of two, bf16's
# largest finite value 0x7F7F and the overflow threshold 0x7F7F8000 (half an ulp above it,
# a tie whose even neighbour is Inf), Inf, and NaNs with payloads, including ones whose upper
# half alone would read as Inf or whose rounding increment would carry into the sign bit.
# NaN becomes the wire format's canonical bf16 NaN.

BF16_CANONICAL_NAN = zq.wire_format.CANONICAL_NAN_BITS[torch.bfloat16]
BF16_EXHAUSTIVE_VARIABLE = "ZCOMM_BF16_EXHAUSTIVE"


def _nearest_even_bf16(bits: np.ndarray) -> np.ndarray:
    """IEEE round-to-nearest-even of fp32 bit patterns that are not NaN, from its definition: of
    the two bf16 magnitudes around |x| (its upper half, and that plus one ulp; 0x7F80 counts as
    2^128, where IEEE's overflow rule puts Inf), the nearer one, the even one on a tie. Every
    value here and each difference is exact in fp64."""
    sign = (bits >> 16) & np.uint32(0x8000)
    magnitude = bits & np.uint32(0x7FFFFFFF)
    inf = magnitude == 0x7F800000
    finite = np.where(inf, np.uint32(0), magnitude)  # Inf is its own bf16; the arithmetic runs on numbers
    down = finite >> 16
    up = down + 1
    value = finite.view(np.float32).astype(np.float64)
    below = (down << 16).view(np.float32).astype(np.float64)
    above = np.where(up == 0x7F80, 2.0**128, (up << 16).view(np.float32).astype(np.float64))
    to_down, to_up = value - below, above - value
    choice = np.where(to_down < to_up, down, np.where(to_up < to_down, up, np.where(down % 2 == 0, down, up)))
    return (sign | np.where(inf, 0x7F80, choice)).astype(np.uint16)


def _ieee_bf16(bits: np.ndarray) -> np.ndarray:
    """torch's float32 -> bfloat16 rounding of fp32 bit patterns, checked against
    _nearest_even_bf16 on every input that is not a NaN; NaN made the canonical NaN."""
    values = torch.from_numpy(bits.view(np.float32))
    rounded = values.to(torch.bfloat16)
    nan = torch.isnan(values).numpy()
    assert np.array_equal(torch.isnan(rounded).numpy(), nan)  # the oracle keeps NaNs NaN
    got = rounded.view(torch.int16).numpy().view(np.uint16)
    numbers = ~nan
    assert np.array_equal(got[numbers], _nearest_even_bf16(bits[numbers])), "torch's rounding is not IEEE's"
    return np.where(nan, np.uint16(BF16_CANONICAL_NAN), got)


# the low 16 bits (the part rounded away): 0 exact; 0x8000 the tie (with the kept value's
# lowest bit, bit 16, both even and odd among the kept mantissas); 0x7FFF / 0x8001 just below
# and above it; the smallest and largest nonzero remainders; patterns between
_BF16_LOWS = (0, 1, 2, 0x3FFF, 0x5555, 0x7FFF, 0x8000, 0x8001, 0xAAAA, 0xFFFE, 0xFFFF)
_BF16_SPECIAL = (
    0x7F7F7FFF, 0x7F7F8000, 0x7F7F8001, 0x7F7FFFFF, 0x7F7E8000, 0x7F800000,  # largest finite, overflow tie, Inf
    0x7F800001, 0x7F80FFFF, 0x7FBFFFFF, 0x7FC00000, 0x7FC00001, 0x7FFF8000, 0x7FFFFFFF,  # NaNs with payloads
    0x00000001, 0x00007FFF, 0x00008000, 0x00018000, 0x007F7FFF, 0x007F8000, 0x007FFFFF,  # subnormals
    0x00800000, 0x3F808000, 0x3F818000, 0x3FFFFFFF, 0x3F7F8000,  # smallest normal, ties, binade tops
)


def _bf16_dense_patterns() -> np.ndarray:
    """Every sign, exponent and bf16 mantissa (bits 16-22) with each low half of _BF16_LOWS,
    then _BF16_SPECIAL with both signs."""
    kept = (np.arange(128, dtype=np.uint32) << 16)[:, None] | np.array(_BF16_LOWS, dtype=np.uint32)[None, :]
    exponents = np.arange(256, dtype=np.uint32) << 23
    signs = np.array([0, 1 << 31], dtype=np.uint32)
    dense = (signs[:, None, None] | exponents[None, :, None] | kept.ravel()[None, None, :]).ravel()
    special = np.array(_BF16_SPECIAL, dtype=np.uint32)
    return np.concatenate([dense, special, special | np.uint32(1 << 31)])


def test_bf16_rounding_dense_sweep(host_check):
    bits = _bf16_dense_patterns()
    assert bits.size % 2 == 0
    _check_patterns(host_check, bits, "narrow_bf16")


# Every pattern of the fp32 binades where bf16's rounding meets a boundary: exponent 0 (zero and
# the subnormals, whose top rounds up to the smallest normal), 254 (bf16's largest finite
# value, 0x7F7F8000 and above to Inf), 255 (Inf and every NaN).
@pytest.mark.parametrize("sign", (0, 1))
@pytest.mark.parametrize("exponent", (0, 254, 255))
def test_bf16_rounding_exhaustive_binades(host_check, exponent, sign):
    _check_range(host_check, (sign << 31) | (exponent << 23), 1 << 23, "narrow_bf16")


@pytest.mark.skipif(os.environ.get(BF16_EXHAUSTIVE_VARIABLE) != "1",
                    reason=f"all 2**32 fp32 patterns take minutes: set {BF16_EXHAUSTIVE_VARIABLE}=1")
def test_bf16_rounding_every_fp32(host_check):
    chunk = 1 << 26
    for first in range(0, 1 << 32, chunk):
        _check_range(host_check, first, chunk, "narrow_bf16")


def test_bf16_nan_halves(host_check, tmp_path):
    """[Note: bf16 NaN halves] (sm_80 to sm_89's NaN test of the fix-up): 0xFFFF in exactly the
    halves that are bf16 NaNs, for every 16-bit pattern in either half next to halves that
    border the NaNs (so that a carry or a leak between the halves would show)."""
    every = np.arange(1 << 16, dtype=np.uint32)
    neighbours = np.array([0, 1, 0x7F7F, 0x7F80, 0x7F81, 0x7FC0, 0x7FFF, 0x8000, 0xFF80, 0xFF81, 0xFFFF],
                          dtype=np.uint32)
    words = np.concatenate([(every[:, None] | (neighbours[None, :] << 16)).ravel(),
                            ((every[:, None] << 16) | neighbours[None, :]).ravel()])
    words.tofile(tmp_path / "in.bin")
    host_check.run("bf16nan", tmp_path / "in.bin", tmp_path / "out.bin")
    got = np.fromfile(tmp_path / "out.bin", dtype=np.uint32)
    halves = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16)
    nan = torch.isnan(halves).numpy().reshape(-1, 2)
    expected = np.where(nan[:, 0], 0xFFFF, 0) | np.where(nan[:, 1], 0xFFFF0000, 0)
    # 254 of the 2^16 patterns are NaNs (either sign, exponent 0xFF, mantissa not 0), 5 of the neighbours
    assert nan.sum() == 2 * (254 * neighbours.size + (1 << 16) * 5)
    bad = np.flatnonzero(got != expected.astype(np.uint32))
    assert got.size == words.size and bad.size == 0, [(hex(words[i]), hex(got[i])) for i in bad[:8]]


_NARROWED = {  # dtype: (the IEEE oracle of fp32 bits, its canonical NaN, the sweep of fp32 classes)
    torch.float16: (_ieee_f16, F16_CANONICAL_NAN, _dense_patterns),
    torch.bfloat16: (_ieee_bf16, BF16_CANONICAL_NAN, _bf16_dense_patterns),
}


def _scales_payload(scales: np.ndarray, group_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
    """An INT8 payload whose group g decodes to scale g and its negation, alternately (codes 1
    and -1: 1 * s and -1 * s are exact, subnormals included), and the fp16 or bf16 bits the wire
    format gives it: each scale rounded to nearest even, the canonical NaN for a NaN or Inf scale."""
    oracle, canonical_nan, _ = _NARROWED[dtype]
    codes = np.tile(np.array([1, 0xFF], dtype=np.uint8), scales.size * group_size // 2)
    payload = torch.from_numpy(np.concatenate([codes, scales.view(np.uint8)]))
    finite = np.isfinite(scales.view(np.float32))
    pair = [np.where(finite, oracle(s), np.uint16(canonical_nan)) for s in (scales, scales ^ np.uint32(1 << 31))]
    return payload, np.repeat(np.stack(pair, axis=1), group_size // 2, axis=0).ravel()


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("f16", "bf16"))
@pytest.mark.parametrize("group_size", (8, 6))  # 8: the vector path (team layout); 6: element by element
@pytest.mark.parametrize("backend", ("reference", pytest.param("cuda", marks=requires_gpu)))
def test_narrowing_of_decoded_values(backend, group_size, dtype):
    """The decoders' fp16 and bf16 outputs, on the device the hardware rounding of [Note:
    hardware narrowing] and its NaN fix-up, against the IEEE oracles above: every pattern of the
    dtype's dense sweep, as a scale that its group decodes to (both signs, in both halves of a
    word)."""
    scales = _NARROWED[dtype][2]()
    payload, expected = _scales_payload(scales, group_size, dtype)
    device = "cuda" if backend == "cuda" else "cpu"
    out = zq.dequantize(payload.to(device), expected.size, 8, group_size, dtype, backend=backend)
    got = out.view(torch.int16).cpu().numpy().view(np.uint16)
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, [(hex(scales[i // group_size]), hex(got[i]), hex(expected[i])) for i in bad[:8]]
