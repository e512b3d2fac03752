"""Golden payloads derived by hand from the spec in zcomm/quant/wire_format.py.

The inputs are chosen so every scale is exact (absmax = qmax gives scale 1.0), which lets
the expected bytes be written down without running any backend: these tests pin the spec
itself (nibble order, padding, scale placement, rounding, NaN/Inf/zero groups) for every
backend, on every device it runs on (the ``any_target`` fixture). Two cases pin what version
2 of the format changed: codes are ``rint((x * p) * r)`` with a per-group reciprocal ``r``
(a product that lands on a .5 tie where the division would not), and subnormal scales take
the pre-scale ``p = 2**64``.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from quant_cases import Target
from zcomm import quant
from zcomm.quant.wire_format import WIRE_FORMAT_VERSION

ONE = list(struct.pack("<f", 1.0))
ZERO = list(struct.pack("<f", 0.0))
NAN_BITS = [0x00, 0x00, 0xC0, 0x7F]
INF_BITS = [0x00, 0x00, 0x80, 0x7F]


def _payload(values, bits, group_size, target: Target, dtype=torch.float32):
    return target.run(quant.quantize, torch.tensor(values, dtype=dtype), bits, group_size).tolist()


def test_int8_rounds_half_to_even_and_appends_scale(any_target):
    # absmax 127 -> scale 1.0; 2.5 -> 2 and 1.5 -> 2 (half to even), -0.5 -> 0.
    values = [127.0, -3.0, 2.5, 3.5, -0.5, 0.0, 1.5, -127.0]
    codes = [127, 256 - 3, 2, 4, 0, 0, 2, 256 - 127]
    assert _payload(values, 8, 8, any_target) == codes + ONE


def test_int4_even_element_in_low_nibble(any_target):
    # absmax 7 -> scale 1.0; codes 7,-7,2,-2,0,3,1,-2 packed low nibble first.
    values = [7.0, -7.0, 2.5, -1.5, 0.5, 3.0, 1.0, -2.0]
    assert _payload(values, 4, 8, any_target) == [0x97, 0xE2, 0x30, 0xE1] + ONE


def test_odd_int4_pads_values_to_four_bytes(any_target):
    # 3 values -> 2 bytes (last high nibble 0) + 2 bytes of padding, then one scale.
    assert _payload([7.0, 1.0, -7.0], 4, 4, any_target) == [0x17, 0x09, 0, 0] + ONE


def test_short_last_group_and_zero_group(any_target):
    # Group 0 is all zero (scale 0), group 1 is short (2 elements) with scale 1.
    values = [0.0, 0.0, 0.0, 0.0, 127.0, -64.0]
    expected = [0, 0, 0, 0, 127, 256 - 64] + [0, 0] + ZERO + ONE
    assert _payload(values, 8, 4, any_target) == expected
    assert quant.payload_nbytes(6, 8, 4) == len(expected)


def test_nan_and_inf_groups_store_canonical_scales_and_zero_codes(any_target):
    values = [1.0, float("nan"), 3.0, 4.0, float("-inf"), 5.0, 127.0, 0.0]
    payload = _payload(values, 8, 2, any_target)
    assert payload[:8] == [0, 0, 95, 127, 0, 0, 127, 0]
    scales = [payload[8 + 4 * g : 12 + 4 * g] for g in range(4)]
    assert scales[0] == NAN_BITS
    assert scales[1] == (torch.tensor([4.0]) / 127).view(torch.uint8).tolist()
    assert scales[2] == INF_BITS
    assert scales[3] == ONE


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_groups_dequantize_to_canonical_nan(any_target, dtype):
    values = [1.0, float("inf"), 7.0, 3.0, float("nan"), 7.0]
    payload = any_target.run(quant.quantize, torch.tensor(values, dtype=dtype), 4, 2)
    out = any_target.run(quant.dequantize, payload, 6, 4, 2, dtype)
    bits = out.view(torch.int32 if dtype == torch.float32 else torch.int16).tolist()
    nan = quant.wire_format.CANONICAL_NAN_BITS[dtype]
    nan_signed = nan - (1 << 32) if dtype == torch.float32 and nan >= 1 << 31 else nan
    assert bits[:2] == [nan_signed, nan_signed]
    assert bits[4:] == [nan_signed, nan_signed]
    assert out[2:4].tolist() == [7.0, 3.0]


def test_dequant_reduce_sums_then_divides(any_target):
    first = any_target.run(quant.quantize, torch.tensor([1.0, 2.0, 127.0, 0.0]), 8, 4)
    second = any_target.run(quant.quantize, torch.tensor([3.0, -4.0, -127.0, 0.0]), 8, 4)
    rows = torch.stack([first, second])
    total = any_target.run(quant.dequant_reduce, rows, 4, 8, 4)
    assert total.tolist() == [4.0, -2.0, 0.0, 0.0]
    halved = any_target.run(quant.dequant_reduce, rows, 4, 8, 4, divide_by=2)
    assert halved.tolist() == [2.0, -1.0, 0.0, 0.0]


def test_dequant_reduce_requantizes_into_self_contained_chunks(any_target):
    values = ([127.0, 7.0, 127.0, 1.0], [0.0, 0.0, -127.0, 6.0])
    rows = torch.stack([any_target.run(quant.quantize, torch.tensor(v), 8, 2) for v in values])
    # Every input group is exact (scale 1 or 0). Sums [127, 7 | 0, 7]: chunk 0 has scale 1,
    # chunk 1 has scale fl32(7 / 127) and codes [0, 127].
    chunks = any_target.run(quant.dequant_reduce, rows, 4, 8, 2, requant_chunks=2)
    assert chunks.shape == (2, quant.payload_nbytes(2, 8, 2))
    assert chunks[0].tolist() == [127, 7, 0, 0] + ONE
    scale = (torch.tensor([7.0]) / 127).view(torch.uint8).tolist()
    assert chunks[1].tolist() == [0, 127, 0, 0] + scale


def test_dequant_reduce_requantizes_int8_rows_into_int4_chunks(any_target):
    """qgZ's INT8 first hop: INT8 rows summed, each chunk of the sum written as INT4."""
    values = ([127.0, 7.0, 127.0, 1.0], [0.0, 0.0, -127.0, 6.0])
    rows = torch.stack([any_target.run(quant.quantize, torch.tensor(v), 8, 2) for v in values])
    # Sums [127, 7 | 0, 7]. Chunk 0: absmax 127, scale fl32(127 / 7), codes 7 and
    # round(7 / (127 / 7)) = round(0.3858) = 0. Chunk 1: absmax 7, scale 1, codes 0 and 7.
    chunks = any_target.run(quant.dequant_reduce, rows, 4, 8, 2, requant_chunks=2, requant_bits=4)
    assert chunks.shape == (2, quant.payload_nbytes(2, 4, 2))
    scale = (torch.tensor([127.0]) / 7).view(torch.uint8).tolist()
    assert chunks[0].tolist() == [0x07, 0, 0, 0] + scale
    assert chunks[1].tolist() == [0x70, 0, 0, 0] + ONE


def test_reorder_quantize_moves_slices_before_chunking(any_target):
    x = torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 127.0, 127.0])
    chunks = any_target.run(quant.reorder_quantize, x, [3, 0, 2, 1], 2, 8, 4)
    # Reordered: [127, 127, 1, 1 | 3, 3, 2, 2]; chunk 1 has absmax 3.
    assert chunks[0].tolist() == [127, 127, 1, 1] + ONE
    expected_1 = quant.quantize(torch.tensor([3.0, 3.0, 2.0, 2.0]), 8, 4, backend="reference")
    assert chunks[1].tolist() == expected_1.tolist()


def _f32(hex_literal: str) -> float:
    return float.fromhex(hex_literal)


def test_version_2_multiplies_by_the_groups_reciprocal(any_target):
    # absmax a = 0x1.8306bep+0: scale s = fl32(a / 127) = 0x1.8612e4p-7, r = fl32(1 / s) =
    # 0x1.5004bap+6. For x = 0x1.891f0cp-1, fl32(x * r) is exactly 64.5 (a tie: code 64, even),
    # while fl32(x / s) = 64.500008 would give 65 (version 1).
    a, x = _f32("0x1.8306bep+0"), _f32("0x1.891f0cp-1")
    scale, reciprocal = np.float32(_f32("0x1.8612e4p-7")), np.float32(_f32("0x1.5004bap+6"))
    assert np.float32(a) / np.float32(127) == scale and np.float32(1) / scale == reciprocal
    assert np.float32(x) * reciprocal == np.float32(64.5) and np.float32(x) / scale > np.float32(64.5)
    assert _payload([a, x], 8, 2, any_target) == [127, 64, 0, 0] + list(struct.pack("<f", float(scale)))
    assert WIRE_FORMAT_VERSION == 2


def test_subnormal_scale_is_prescaled_before_its_reciprocal(any_target):
    # absmax 127 * 2^-140 gives the subnormal scale 2^-140, whose reciprocal 2^140 is no fp32
    # number: p = 2^64, r = 1 / 2^-76 = 2^76, and 3 * 2^-140 -> (3 * 2^-76) * 2^76 = 3.
    tiny = 2.0**-140
    values = [127 * tiny, 3 * tiny, -64.5 * tiny, 0.0]
    # -64.5 is a tie: -64 (even)
    expected = [127, 3, 256 - 64, 0] + list(struct.pack("<f", tiny))
    assert _payload(values, 8, 4, any_target) == expected
    int4 = [7 * tiny, -2.5 * tiny]  # scale 2^-140 again; -2.5 -> -2
    assert _payload(int4, 4, 2, any_target) == [0xE7, 0, 0, 0] + list(struct.pack("<f", tiny))
