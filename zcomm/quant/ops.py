"""The four public block-quantization ops: argument checks, output allocation, backend choice.

Each function validates its arguments once, here (``TypeError``/``ValueError`` naming the
argument and what is accepted; bits and group size through
:class:`~zcomm.quant.spec.QuantSpec`, so ``group_size`` may also be ``"tensor"``, one scale
per payload, or ``None``, the width's default), allocates its output unless ``out=`` is
given, picks the backend (``backend=``, then ``ZCOMM_BACKEND``, then the tensor's device)
and calls the ``zcomm::`` operator of :mod:`zcomm.quant._contract` that the backend
implements. The bytes produced are those of :mod:`zcomm.quant.wire_format`. The ops are not
differentiable: inputs that require grad (parameters) are read detached.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from . import _contract, _registry
from .spec import GroupSize, QuantSpec
from .wire_format import SUPPORTED_DTYPES, payload_nbytes


def _check_dtype(dtype: torch.dtype, name: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} must have dtype in ({names}), got {dtype}")


def _check_float_input(x: torch.Tensor, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    _check_dtype(x.dtype, name)
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_payloads(payloads: torch.Tensor, name: str) -> None:
    if not isinstance(payloads, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(payloads).__name__}")
    if payloads.dtype != torch.uint8:
        raise TypeError(f"{name} must have dtype torch.uint8, got {payloads.dtype}")
    if not payloads.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_numel(numel: int, name: str = "numel") -> None:
    if isinstance(numel, bool) or not isinstance(numel, int):
        raise TypeError(f"{name} must be an int, got {numel!r}")
    if numel < 0:
        raise ValueError(f"{name} must be >= 0, got {numel}")


def _check_out(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"out must have dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but the input is on {device}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    if out.numel() != math.prod(shape):
        raise ValueError(f"out must have {math.prod(shape)} elements (shape {shape}), got shape {tuple(out.shape)}")


def _output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    _check_out(out, shape, dtype, device)
    return out.view(shape)


def _as_rows(payloads: torch.Tensor, numel: int, bits: int, group_size: int, name: str) -> torch.Tensor:
    """View ``payloads`` as ``(k, payload_nbytes(numel))`` rows, checking the length."""
    row = payload_nbytes(numel, bits, group_size)
    if payloads.dim() == 1:
        if payloads.numel() != row:
            raise ValueError(
                f"{name} has {payloads.numel()} bytes but numel={numel}, bits={bits}, "
                f"group_size={group_size} needs a payload of {row} bytes"
            )
        return payloads.view(1, row)
    if payloads.dim() != 2 or payloads.shape[1] != row:
        raise ValueError(
            f"{name} must be 1-D ({row} bytes) or 2-D (k, {row}) for numel={numel}, bits={bits}, "
            f"group_size={group_size}; got shape {tuple(payloads.shape)}"
        )
    return payloads


def _spec_group_size(bits: int, group_size: GroupSize, numel: int) -> int:
    """The validated int group size for payloads of ``numel`` elements (``"tensor"``: one group)."""
    return QuantSpec(bits=bits, group_size=group_size).group_size_for(numel)


def quantize(
    x: torch.Tensor, bits: int, group_size: GroupSize, *, backend: str | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize ``x`` (any shape, read flat) into one self-contained payload.

    Returns a 1-D ``uint8`` tensor of ``payload_nbytes(x.numel(), bits, group_size)`` bytes.
    """
    _check_float_input(x, "x")
    group = _spec_group_size(bits, group_size, x.numel())
    name = _registry.select(backend, x.device)
    result = _output(out, (payload_nbytes(x.numel(), bits, group),), torch.uint8, x.device)
    if x.numel():
        _contract.quantize(x.detach().view(-1), bits, group, name, result)
    return result


def dequantize(
    payload: torch.Tensor,
    numel: int,
    bits: int,
    group_size: GroupSize,
    dtype: torch.dtype,
    *,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize one payload (1-D) or ``k`` payloads stacked as rows (2-D ``(k, nbytes)``).

    ``numel`` is the element count of each payload; the result has ``k * numel`` elements
    of ``dtype``, payload ``i`` landing at ``[i * numel, (i + 1) * numel)``.
    """
    _check_payloads(payload, "payload")
    _check_numel(numel)
    group = _spec_group_size(bits, group_size, numel)
    _check_dtype(dtype, "dtype")
    rows = _as_rows(payload, numel, bits, group, "payload")
    name = _registry.select(backend, payload.device)
    result = _output(out, (rows.shape[0] * numel,), dtype, payload.device)
    if result.numel():
        _contract.dequantize(rows, numel, bits, group, name, result)
    return result


def _check_perm(perm: Sequence[int], numel: int) -> tuple[int, ...]:
    if isinstance(perm, torch.Tensor):
        perm = perm.tolist()
    try:
        perm_t = tuple(int(p) for p in perm)
    except TypeError as exc:
        raise TypeError(f"perm must be a sequence of ints, got {perm!r}") from exc
    if not perm_t or sorted(perm_t) != list(range(len(perm_t))):
        raise ValueError(f"perm must be a permutation of range(len(perm)), got {perm_t}")
    if numel % len(perm_t):
        raise ValueError(f"x.numel()={numel} is not divisible into len(perm)={len(perm_t)} equal slices")
    return perm_t


def _check_interleaved(
    x: torch.Tensor | Sequence[torch.Tensor], parts: int, part_numel: int | None
) -> tuple[list[torch.Tensor], int]:
    """``x`` as a list of 1-D tensors of one dtype and device, and the concrete ``part_numel``."""
    tensors = [x] if isinstance(x, torch.Tensor) else list(x)
    if not tensors:
        raise ValueError("x must be a tensor or a non-empty sequence of tensors")
    for index, tensor in enumerate(tensors):
        _check_float_input(tensor, f"x[{index}]" if len(tensors) > 1 else "x")
        if tensor.dtype != tensors[0].dtype or tensor.device != tensors[0].device:
            raise ValueError(
                f"x[{index}] is {tensor.dtype} on {tensor.device} but x[0] is {tensors[0].dtype} on {tensors[0].device}"
            )
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a positive int, got {parts!r}")
    for index, tensor in enumerate(tensors):
        if tensor.numel() % parts:
            raise ValueError(f"x[{index}].numel()={tensor.numel()} is not divisible into parts={parts} equal pieces")
    filled = sum(tensor.numel() for tensor in tensors) // parts
    if part_numel is None:
        return [t.detach().view(-1) for t in tensors], filled
    _check_numel(part_numel, "part_numel")
    if part_numel < filled:
        raise ValueError(f"part_numel={part_numel} is shorter than the {filled} elements each part holds")
    return [t.detach().view(-1) for t in tensors], part_numel


def reorder_quantize(
    x: torch.Tensor | Sequence[torch.Tensor],
    perm: Sequence[int],
    num_chunks: int,
    bits: int,
    group_size: GroupSize,
    *,
    parts: int = 1,
    part_numel: int | None = None,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reorder the slices of ``x``, then quantize into ``num_chunks`` self-contained payloads.

    ``x`` is a tensor, or tensors of one dtype and device read as their *interleaving*:
    ``parts`` parts, part ``r`` holding the ``r``-th of ``parts`` equal pieces of each
    tensor in turn, zero-filled to ``part_numel`` elements (default: no fill). With one
    tensor and no fill that is the tensor itself (any ``parts``). The tensors are read where
    they are; the interleaved tensor is never built. It is viewed as ``len(perm)`` equal
    slices; output slice ``p`` is input slice ``perm[p]``. The reordered tensor is cut into
    ``num_chunks`` equal pieces, each quantized as its own payload (own groups, own
    scales), so row ``c`` of the result can be handed to peer ``c`` of an all-to-all.
    Returns ``(num_chunks, payload_nbytes(parts * part_numel // num_chunks))``.
    """
    tensors, part_numel = _check_interleaved(x, parts, part_numel)
    numel = parts * part_numel
    perm_t = _check_perm(perm, numel)
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    if numel % num_chunks:
        raise ValueError(f"x.numel()={numel} is not divisible into num_chunks={num_chunks} equal chunks")
    chunk = numel // num_chunks
    group = _spec_group_size(bits, group_size, chunk)
    device = tensors[0].device
    name = _registry.select(backend, device)
    result = _output(out, (num_chunks, payload_nbytes(chunk, bits, group)), torch.uint8, device)
    if numel:
        _contract.reorder_quantize(tensors, parts, part_numel, perm_t, num_chunks, bits, group, name, result)
    return result


def _check_requant_chunks(requant_chunks: int, numel: int) -> None:
    if isinstance(requant_chunks, bool) or not isinstance(requant_chunks, int) or requant_chunks < 1:
        raise ValueError(f"requant_chunks must be a positive int or None, got {requant_chunks!r}")
    if numel % requant_chunks:
        raise ValueError(f"numel={numel} is not divisible into requant_chunks={requant_chunks} equal chunks")


def dequant_reduce(
    payloads: torch.Tensor,
    numel: int,
    bits: int,
    group_size: GroupSize,
    *,
    dtype: torch.dtype = torch.float32,
    requant_chunks: int | None = None,
    requant_bits: int | None = None,
    divide_by: float = 1.0,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize ``k`` payloads, sum them in fp32, and return the sum or its re-quantization.

    ``payloads`` is 2-D ``(k, payload_nbytes(numel))`` as an all-to-all delivers them. The
    fp32 sum (in row order, then divided by ``divide_by``) is returned as ``numel`` elements
    of ``dtype``, or, with ``requant_chunks=m``, re-quantized in the same pass (same group
    size; ``requant_bits`` bits, by default ``bits``) into ``(m, payload_nbytes(numel // m))``
    self-contained payloads: the same bytes as :func:`reorder_quantize` of the fp32 sum,
    without the sum ever being stored. With ``group_size="tensor"`` every input payload and
    every re-quantized chunk has one scale.
    """
    _check_payloads(payloads, "payloads")
    _check_numel(numel)
    if requant_bits is not None and requant_chunks is None:
        raise ValueError("requant_bits needs requant_chunks (it is the width of the re-quantized payloads)")
    out_bits = bits if requant_bits is None else requant_bits
    # "tensor": a group of the inputs' size covers every chunk of the sum in one group too;
    # the larger resolution is valid for both widths (INT4 rounds an odd size up, which
    # leaves one group per payload and so the same bytes)
    group = max(_spec_group_size(b, group_size, numel) for b in (bits, out_bits))
    if payloads.dim() != 2 or payloads.shape[0] < 1:
        raise ValueError(f"payloads must be 2-D (k >= 1, nbytes), got shape {tuple(payloads.shape)}")
    rows = _as_rows(payloads, numel, bits, group, "payloads")
    if isinstance(divide_by, bool) or not isinstance(divide_by, (int, float)) or not divide_by > 0:
        raise ValueError(f"divide_by must be a positive number, got {divide_by!r}")
    if requant_chunks is None:
        _check_dtype(dtype, "dtype")
        shape, out_dtype = (numel,), dtype
    else:
        _check_requant_chunks(requant_chunks, numel)
        shape = (requant_chunks, payload_nbytes(numel // requant_chunks, out_bits, group))
        out_dtype = torch.uint8
    name = _registry.select(backend, payloads.device)
    result = _output(out, shape, out_dtype, payloads.device)
    if numel and requant_chunks is None:
        _contract.dequant_reduce(rows, numel, bits, group, float(divide_by), name, result)
    elif numel:
        _contract.dequant_reduce_requant(rows, numel, bits, out_bits, group, float(divide_by), name, result)
    return result
