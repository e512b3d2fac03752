"""The zcomm wire format, version 2: blocked, symmetric INT8 / INT4 payloads with fp32 scales.

This module is the single written-down definition of the bytes that every quantized
collective puts on the wire. Every backend (``reference``, ``cpu``, ``cuda``) must produce
these exact bytes for the same input; the tests compare them byte for byte.

Versions. A payload carries no version number: its layout (values, padding, scales) is
the same in every version, and a reader decodes any version's payload correctly. What a
version fixes is the *encoder's* arithmetic: version 2 multiplies by a per-group
reciprocal where version 1 divided every element by the scale, so the same input can give
codes that differ by one. Every rank of a job must run the same version
(:data:`WIRE_FORMAT_VERSION`): the backends of one build agree byte for byte, but payloads
of different versions, and any test or checkpoint that pins exact bytes, do not.

Groups
    A 1-D tensor of ``n`` elements (fp32, bf16 or fp16) is split into
    ``G = ceil(n / group_size)`` groups of ``group_size`` consecutive elements; the last
    group may be short (``group_size="tensor"`` makes one group of the whole payload, see
    :class:`~zcomm.quant.spec.QuantSpec`). Every element is first converted to fp32 (exact
    for all three input dtypes); all arithmetic below is IEEE fp32 with round-to-nearest-even,
    no fused multiply-add and no flush-to-zero.

Scale of a group (``qmax = 2**(bits - 1) - 1``: 127 for INT8, 7 for INT4)
    * the group holds a NaN            -> ``scale = NaN`` (canonical quiet NaN, 0x7FC00000)
    * else the group holds a +-Inf     -> ``scale = +Inf``
    * else ``absmax = max |x|`` and ``scale = absmax / qmax`` (an fp32 *division*).
    An all-zero group therefore has ``scale = 0``.

Quantized values
    * ``scale`` is 0, NaN or Inf        -> ``q = 0`` for the whole group
    * else, once per group, the pre-scale ``p`` and the reciprocal ``r``:
      ``p = 2**64`` if ``scale`` is subnormal (``scale < 2**-126``), else ``p = 1``;
      ``r = 1 / (scale * p)``, an fp32 *division* (``scale * p`` is exact);
      then per element ``q = clamp(rint((x * p) * r), -qmax, qmax)``: two fp32
      multiplications (``x * p`` is exact; with ``p = 1`` it is ``x`` itself), never a
      division, and ``rint`` rounds half to even.

      ``p`` exists only so that ``r`` stays finite and correctly rounded: a subnormal scale
      below ``2**-128`` has no finite fp32 reciprocal, and ``0 * Inf`` would be NaN. With
      ``|x| <= qmax * scale`` the product ``(x * p) * r`` is finite, so the clamp is an
      ordinary one. ``x * r`` and ``x / scale`` differ by at most two roundings
      (``|x / scale| * 2**-23``), so a code can differ from version 1's by one where
      ``x / scale`` is within that of a .5 tie.
Dequantized values
    * ``scale`` is NaN or Inf           -> every element is the canonical NaN
      (never a finite number: training code relies on non-finite values to detect overflow)
    * else ``y = float32(q) * scale`` (fp32 multiply), then converted to the requested
      dtype with round-to-nearest-even (bf16: canonical NaN 0x7FC0; fp16: 0x7E00,
      overflow to +-Inf). ``scale = 0`` gives exact (+0) zeros.

Payload layout (one contiguous ``uint8`` buffer, so one collective carries values and scales)
    ``[ values | zero padding to a multiple of 4 bytes | G fp32 scales, little-endian ]``

    * INT8: ``n`` bytes, one two's-complement int8 per element.
    * INT4: ``ceil(n / 2)`` bytes; element ``2i`` is in the **low** nibble of byte ``i`` and
      element ``2i + 1`` in the **high** nibble, each as a 4-bit two's-complement number
      (-7..7). An odd ``n`` leaves the last high nibble 0. INT4 needs an even
      ``group_size`` so that every group starts on a byte boundary.
    * ``n = 0`` gives an empty payload.

    Every payload length is a multiple of 4, so payloads stacked as rows of a 2-D
    ``(k, payload_nbytes)`` tensor (what an all-to-all delivers) keep their scales aligned.

Reductions (``dequant_reduce``)
    ``k`` payloads of the same ``n`` are dequantized to fp32 as above and summed in payload
    order: ``acc = d_0; acc = acc + d_1; ...`` (no leading ``0 +``, which would turn -0 into +0).
    An optional divisor is applied as one fp32 division ``acc / float32(divide_by)`` at the end.
    Any NaN is then made the canonical NaN. The result is converted to the requested dtype,
    or re-quantized into ``m`` self-contained payloads of ``n / m`` elements each, with the
    group rules above applied to the fp32 sums.
"""

from __future__ import annotations

import torch

from .spec import SUPPORTED_BITS, GroupSize, QuantSpec

WIRE_FORMAT_VERSION = 2
QMAX: dict[int, int] = {bits: 2 ** (bits - 1) - 1 for bits in SUPPORTED_BITS}
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
SCALE_BYTES = 4
ALIGN = 4
# Subnormal scales (below 2**-126) are multiplied by SUBNORMAL_PRESCALE before taking the
# reciprocal, and so is every element of their group (see "Quantized values" above).
SUBNORMAL_PRESCALE = 2.0**64
SMALLEST_NORMAL_F32 = 2.0**-126

CANONICAL_NAN_BITS = {torch.float32: 0x7FC00000, torch.bfloat16: 0x7FC0, torch.float16: 0x7E00}


def _align_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def num_groups(numel: int, group_size: int) -> int:
    """Number of quantization groups for ``numel`` elements (the last may be short)."""
    return (numel + group_size - 1) // group_size


def values_nbytes(numel: int, bits: int) -> int:
    """Bytes taken by the packed quantized values (before padding)."""
    return numel if bits == 8 else (numel + 1) // 2


def scales_offset(numel: int, bits: int) -> int:
    """Byte offset of the fp32 scales inside a payload."""
    return _align_up(values_nbytes(numel, bits), ALIGN)


def payload_nbytes(numel: int, bits: int, group_size: GroupSize) -> int:
    """Total length in bytes of the payload for ``numel`` elements.

    ``bits`` and ``group_size`` are those of a :class:`~zcomm.quant.spec.QuantSpec` (an int,
    ``"tensor"`` for one scale per payload, or ``None`` for the width's default).
    """
    group_size = QuantSpec(bits=bits, group_size=group_size).group_size_for(numel)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if numel == 0:
        return 0
    return scales_offset(numel, bits) + SCALE_BYTES * num_groups(numel, group_size)
