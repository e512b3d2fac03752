"""Property tests (hypothesis) of the ``cpu`` backend's round trip and of its agreement with
the reference on arbitrary bit patterns.

Round-trip bound, per element x of a group with fp32 scale s and qmax Q, for
y = dequantize(quantize(x)) computed in fp32 and then rounded to the output dtype:

    |x - y| <= s / 2                     rounding x / s to an integer code
             + Q * s * 2^-22             fp32 rounding of x / s, and of s = absmax / Q
                                         (which can push |x / s| past Q before the clamp)
             + Q * 2^-149                a subnormal s is off absmax / Q by up to 2^-150
                                         absolutely (a group under Q/2 * 2^-149 gets s = 0)
             + (|x| + s) * u + t         rounding y (|y| <= |x| + s) to the output dtype:
                                         u = 2^-24 (fp32), 2^-8 (bf16), 2^-11 (fp16); t its
                                         half subnormal step

Only elements within that bound of the output dtype's largest finite value may come back
as Inf (q * s can round past fp32's largest finite value; fp16 cannot hold large values).
Examples are derandomized so CI sees the same cases on every run.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import zcomm.quant as q
from quant_cases import DTYPES, assert_same_bytes

_OUTPUT_ROUNDING = {  # (relative half ulp, absolute half subnormal step)
    torch.float32: (2.0**-24, 2.0**-150),
    torch.bfloat16: (2.0**-8, 2.0**-134),
    torch.float16: (2.0**-11, 2.0**-25),
}
_SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def _cases(draw, finite: bool):
    dtype = draw(st.sampled_from(DTYPES))
    bits = draw(st.sampled_from((4, 8)))
    group_size = draw(st.sampled_from((2, 4, 32, 128, 512)))
    numel = draw(st.integers(1, 600))
    info = torch.finfo(dtype)
    np_dtype = np.float16 if dtype == torch.float16 else np.float32
    elements = st.floats(-info.max, info.max, width=np.dtype(np_dtype).itemsize * 8)
    if not finite:
        elements = elements | st.sampled_from((math.nan, math.inf, -math.inf))
    values = draw(arrays(np_dtype, numel, elements=elements))
    return torch.from_numpy(values).to(dtype), bits, group_size


def _group_scales(payload: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    return payload[q.scales_offset(numel, bits) :].view(torch.float32).double()


@_SETTINGS
@given(_cases(finite=True))
def test_round_trip_error_is_bounded_by_half_a_scale(case) -> None:
    x, bits, group_size = case
    numel = x.numel()
    payload = q.quantize(x, bits, group_size, backend="cpu")
    scale = _group_scales(payload, numel, bits).repeat_interleave(group_size)[:numel]
    qmax = q.QMAX[bits]
    x = x.double()
    for dtype in DTYPES:
        y = q.dequantize(payload, numel, bits, group_size, dtype, backend="cpu").double()
        relative, absolute = _OUTPUT_ROUNDING[dtype]
        bound = scale / 2 + qmax * scale * 2.0**-22 + qmax * 2.0**-149 + (x.abs() + scale) * relative + absolute
        # Only the top of the output range may overflow: an element may come back as Inf only
        # where the bound lets |y| reach the dtype's largest finite value (q * s rounding past
        # it, or a value fp16 cannot hold).
        overflow = ~y.isfinite()
        assert torch.all(x[overflow].abs() + bound[overflow] >= torch.finfo(dtype).max), f"to {dtype}"
        error = (x - y).abs()[~overflow]
        excess = (error - bound[~overflow]).max().item() if error.numel() else 0.0
        assert excess <= 0, f"to {dtype}: error exceeds the bound by {excess}"


@_SETTINGS
@given(_cases(finite=False))
def test_non_finite_groups_dequantize_to_non_finite(case) -> None:
    x, bits, group_size = case
    numel = x.numel()
    payload = q.quantize(x, bits, group_size, backend="cpu")
    groups = math.ceil(numel / group_size)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group_size - numel))
    bad_group = (~torch.isfinite(padded.view(groups, group_size))).any(dim=1)
    bad = bad_group.repeat_interleave(group_size)[:numel]
    for dtype in DTYPES:
        y = q.dequantize(payload, numel, bits, group_size, dtype, backend="cpu")
        assert not torch.isfinite(y[bad]).any(), f"a NaN/Inf group dequantized to finite {dtype} values"


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    bits=st.sampled_from((4, 8)),
    group_size=st.sampled_from((2, 6, 64)),
    words=arrays(np.uint32, st.integers(1, 400)),
)
def test_cpu_matches_reference_on_any_bit_pattern(dtype: torch.dtype, bits: int, group_size: int, words) -> None:
    """Every float class at once: signed zeros, subnormals, NaN payloads, Inf, extremes."""
    x = torch.from_numpy(words if dtype == torch.float32 else words.astype(np.uint16)).view(dtype)
    expected = q.quantize(x, bits, group_size, backend="reference")
    assert_same_bytes(q.quantize(x, bits, group_size, backend="cpu"), expected, "quantize")
    for out_dtype in DTYPES:
        ref = q.dequantize(expected, x.numel(), bits, group_size, out_dtype, backend="reference")
        got = q.dequantize(expected, x.numel(), bits, group_size, out_dtype, backend="cpu")
        assert_same_bytes(got, ref, f"dequantize to {out_dtype}")
