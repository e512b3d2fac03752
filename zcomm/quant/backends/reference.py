"""The ``reference`` backend: plain torch, written to be obviously right, not fast.

It is the oracle the ``cpu`` and ``cuda`` backends are tested against, byte for byte. Each
step follows :mod:`zcomm.quant.wire_format` literally: pad to whole groups, per-group
NaN/Inf/absmax, the fp32 scale and per-group reciprocal, fp32 multiplications, round half to
even, clamp, pack, append the scales. It runs
on CPU and CUDA tensors with the same bytes.

[Note: true division on CUDA] ATen's CUDA division (``div_true_kernel_cuda``) computes
``tensor / cpu_scalar`` as ``tensor * (1 / scalar)`` (one more rounding), and a Python
number is such a CPU scalar; only a divisor *tensor on the dividend's device* takes the
IEEE ``a / b`` path (``DivFunctor``). So every division here divides by a tensor made on
the dividend's device (``new_full``), which is also what CPU tensors compute.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .._contract import implements
from ..wire_format import (
    CANONICAL_NAN_BITS,
    QMAX,
    SMALLEST_NORMAL_F32,
    SUBNORMAL_PRESCALE,
    num_groups,
    scales_offset,
    values_nbytes,
)

_NAN = float("nan")


def _group_view(values: torch.Tensor, group_size: int) -> torch.Tensor:
    """``values`` zero-padded to whole groups, as ``(G, group_size)``."""
    pad = num_groups(values.numel(), group_size) * group_size - values.numel()
    return torch.nn.functional.pad(values, (0, pad)).view(-1, group_size)


def _divide(dividend: torch.Tensor, divisor: float) -> torch.Tensor:
    """fp32 ``dividend / fp32(divisor)`` correctly rounded on every device ([Note: true division on CUDA])."""
    return dividend / dividend.new_full((), divisor)


def _scales(groups: torch.Tensor, qmax: int) -> torch.Tensor:
    absmax = groups.abs().amax(dim=1)
    scale = _divide(absmax, qmax)
    scale = torch.where(torch.isinf(groups).any(dim=1), torch.full_like(scale, float("inf")), scale)
    return torch.where(torch.isnan(groups).any(dim=1), torch.full_like(scale, _NAN), scale)


def _quantize_values(values: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``values`` -> (int8 codes of ``values.numel()``, fp32 scales per group).

    Codes are ``rint((x * p) * r)`` with the per-group pre-scale ``p`` and reciprocal
    ``r = 1 / (scale * p)`` of the wire format (``p`` is 1 but for subnormal scales).
    """
    qmax = QMAX[bits]
    groups = _group_view(values, group_size)
    scale = _scales(groups, qmax)
    usable = torch.isfinite(scale) & (scale != 0)
    divisor = torch.where(usable, scale, torch.ones_like(scale))
    prescale = torch.where(divisor < SMALLEST_NORMAL_F32, SUBNORMAL_PRESCALE, 1.0).to(torch.float32)
    # a tensor divided by a tensor on its own device: the IEEE division ([Note: true division on CUDA])
    reciprocal = torch.ones_like(divisor) / (divisor * prescale)
    codes = torch.round((groups * prescale[:, None]) * reciprocal[:, None]).clamp(-qmax, qmax)
    codes = torch.where(usable[:, None], codes, torch.zeros_like(codes))
    return codes.reshape(-1)[: values.numel()].to(torch.int8), scale


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return codes.view(torch.uint8)
    nibbles = codes.to(torch.int16) & 0xF
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
    return (nibbles[0::2] | (nibbles[1::2] << 4)).to(torch.uint8)


def _unpack(packed: torch.Tensor, numel: int, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed.view(torch.int8)
    as_int = packed.to(torch.int16)
    nibbles = torch.stack([as_int & 0xF, as_int >> 4], dim=1).reshape(-1)[:numel]
    return torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.int8)


def _encode(values: torch.Tensor, bits: int, group_size: int, out: torch.Tensor) -> None:
    """Quantize fp32 ``values`` into the payload ``out`` (wire layout)."""
    codes, scale = _quantize_values(values, bits, group_size)
    packed = _pack(codes, bits)
    offset = scales_offset(values.numel(), bits)
    out.zero_()
    out[: packed.numel()] = packed
    out[offset:] = scale.contiguous().view(torch.uint8)


def _decode(payload: torch.Tensor, numel: int, bits: int, group_size: int) -> torch.Tensor:
    """One payload -> its ``numel`` values in fp32 (non-finite scales give canonical NaN)."""
    codes = _unpack(payload[: values_nbytes(numel, bits)], numel, bits)
    offset = scales_offset(numel, bits)
    scale = payload[offset : offset + 4 * num_groups(numel, group_size)].clone().view(torch.float32)
    per_element = scale.repeat_interleave(group_size)[:numel]
    values = codes.to(torch.float32) * per_element
    return torch.where(torch.isfinite(per_element), values, torch.full_like(values, _NAN))


def _canonical_nan(values: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(values), torch.full_like(values, _NAN), values)


def _store(values: torch.Tensor, out: torch.Tensor) -> None:
    """Convert fp32 ``values`` into ``out``'s dtype, writing NaNs as the canonical pattern.

    torch's own vectorized fp32 -> bf16 conversion writes NaN as 0xFFFF, so the NaN
    positions are rewritten from the bit pattern the wire format names (with ``where``, so
    no host sync on CUDA).
    """
    converted = values.to(out.dtype)
    if out.dtype != torch.float32:
        bits = converted.view(torch.int16)
        converted = torch.where(torch.isnan(values), CANONICAL_NAN_BITS[out.dtype], bits).view(out.dtype)
    out.copy_(converted)


@implements("quantize", "reference")
def quantize(x: torch.Tensor, bits: int, group_size: int, out: torch.Tensor) -> None:
    _encode(x.to(torch.float32), bits, group_size, out)


@implements("dequantize", "reference")
def dequantize(payloads: torch.Tensor, numel: int, bits: int, group_size: int, out: torch.Tensor) -> None:
    for row in range(payloads.shape[0]):
        _store(_decode(payloads[row], numel, bits, group_size), out[row * numel : (row + 1) * numel])


@implements("reorder_quantize", "reference")
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
    pieces = [x.to(torch.float32).view(parts, x.numel() // parts) for x in xs]
    filled = sum(piece.shape[1] for piece in pieces)
    fill = torch.zeros(parts, part_numel - filled, dtype=torch.float32, device=out.device)
    slices = torch.cat([*pieces, fill], dim=1).view(len(perm), -1)
    # concatenated views, not an index tensor, which would be copied from the host (a sync on CUDA)
    reordered = torch.cat([slices[p] for p in perm]).reshape(num_chunks, -1)
    for chunk in range(num_chunks):
        _encode(reordered[chunk], bits, group_size, out[chunk])


def _reduce(payloads: torch.Tensor, numel: int, bits: int, group_size: int, divide_by: float) -> torch.Tensor:
    """The fp32 sum of the payload rows in row order, divided by ``fp32(divide_by)``, NaNs canonical."""
    acc = _decode(payloads[0], numel, bits, group_size)
    for row in range(1, payloads.shape[0]):
        acc = acc + _decode(payloads[row], numel, bits, group_size)
    if divide_by != 1.0:
        acc = _divide(acc, divide_by)
    return _canonical_nan(acc)


@implements("dequant_reduce", "reference")
def dequant_reduce(
    payloads: torch.Tensor, numel: int, bits: int, group_size: int, divide_by: float, out: torch.Tensor
) -> None:
    _store(_reduce(payloads, numel, bits, group_size, divide_by), out)


@implements("dequant_reduce_requant", "reference")
def dequant_reduce_requant(
    payloads: torch.Tensor, numel: int, bits: int, out_bits: int, group_size: int, divide_by: float, out: torch.Tensor
) -> None:
    acc = _reduce(payloads, numel, bits, group_size, divide_by)
    for chunk, values in enumerate(acc.view(out.shape[0], -1)):
        _encode(values, out_bits, group_size, out[chunk])
