"""The four public block-quantization ops: argument checks, output allocation, backend choice.

Each function validates its arguments once, here (``TypeError``/``ValueError`` naming the
argument and what is accepted; bits and group size through
:class:`~zcomm.quant.spec.QuantSpec`, so ``group_size`` may also be ``"tensor"``, one scale
per payload, or ``None``, the width's default), allocates its output unless ``out=`` is
given, picks the operator namespace (``backend=``, then ``ZCOMM_BACKEND``, then the
tensor's device: ``torch.ops.zcomm`` for the device's native backend,
``torch.ops.zcomm_reference`` for the reference oracle; [Note: backend dispatch] in
:mod:`zcomm.quant._contract`) and calls the op, which runs the kernel without checking
again ([Note: validation at the boundary]). The bytes produced are those of
:mod:`zcomm.quant.wire_format`. The ops are not differentiable: inputs that require grad
(parameters) are read detached.

The checks are written for a short host path (a quantize of a few thousand elements costs
about as much host time as a torch op): specs are cached per ``(bits, group_size)``, and
the common case (contiguous input, preallocated or fresh output, default backend) takes a
handful of attribute reads; ``tests/quant/test_host_path.py`` counts the Python calls of
one op so that a regression shows on any machine.
"""

from __future__ import annotations

import math
from os import environ as _environ
from typing import Sequence

import torch

from . import _contract, _registry
from ._bounded_cache import BoundedCache
from ._plain import PLAIN_TENSORS
from .spec import GroupSize, QuantSpec
from .wire_format import ALIGN, SCALE_BYTES, SUPPORTED_DTYPES

_REFERENCE = "reference"
_OPS = _contract.OPS
_REFERENCE_OPS = _contract.REFERENCE_OPS
_UINT8 = torch.uint8
_NATIVE_DEVICE_TYPES = frozenset(_contract.NATIVE_BACKENDS)
# (type(bits), bits, type(group_size), group_size) -> (the validated spec, its int group size
# or None for "tensor"); the types keep True / 8.0 from hitting the entries of 1 / 8. Any int
# from 2 up is a valid group size, so a caller sweeping them could grow it without end: at most
# _MAX_SPECS entries, the oldest dropped first (a hit is a plain dict lookup).
_MAX_SPECS = 256
_SPECS: BoundedCache = BoundedCache(_MAX_SPECS)
_FLOAT_DTYPES = frozenset(SUPPORTED_DTYPES)


def _spec(bits: int, group_size: GroupSize) -> tuple[QuantSpec, int | None]:
    """The :class:`QuantSpec` of ``(bits, group_size)`` (validated once and cached) and its int
    group size (None for ``"tensor"``, resolved per payload by ``group_size_for``)."""
    key = (type(bits), bits, type(group_size), group_size)
    try:
        return _SPECS[key]
    except KeyError:
        pass
    except TypeError:  # unhashable group_size: QuantSpec says what is accepted
        QuantSpec(bits=bits, group_size=group_size)
        raise AssertionError("an unhashable group_size passed QuantSpec") from None
    spec = QuantSpec(bits=bits, group_size=group_size)
    return _SPECS.remember(key, (spec, None if spec.per_tensor else spec.group_size))


def _ops(backend: str | None, device: torch.device) -> dict[str, torch._ops.OpOverload]:
    """The ops that run on ``device`` for ``backend``, then ``$ZCOMM_BACKEND``, then the device
    ([Note: backend dispatch])."""
    if backend is None:
        backend = _environ.get(_registry.BACKEND_VARIABLE) or None
        if backend is None and device.type in _NATIVE_DEVICE_TYPES:
            return _OPS
    return _REFERENCE_OPS if _registry.select(backend, device) == _REFERENCE else _OPS


def _row_nbytes(numel: int, bits: int, group_size: int) -> int:
    """``payload_nbytes`` for a concrete int ``group_size`` the caller already validated
    (:mod:`zcomm.quant.wire_format`'s arithmetic in one expression: values, padding to
    :data:`ALIGN`, one fp32 scale per group)."""
    if not numel:
        return 0
    values = numel if bits == 8 else (numel + 1) // 2
    return (values + ALIGN - 1) // ALIGN * ALIGN + SCALE_BYTES * ((numel + group_size - 1) // group_size)


def _group_size(bits: int, group_size: GroupSize, numel: int) -> int:
    """The validated int group size for payloads of ``numel`` elements (``"tensor"``: one group)."""
    spec, group = _spec(bits, group_size)
    return spec.group_size_for(numel) if group is None else group


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
    if payloads.dtype != _UINT8:
        raise TypeError(f"{name} must have dtype torch.uint8, got {payloads.dtype}")
    if not payloads.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_numel(numel: int, name: str = "numel") -> None:
    if type(numel) is not int:
        raise TypeError(f"{name} must be an int, got {numel!r}")
    if numel < 0:
        raise ValueError(f"{name} must be >= 0, got {numel}")


def _output(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``out`` checked and viewed as ``shape``, or a fresh tensor of ``shape`` when None."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
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
    return out if out.shape == shape else out.view(shape)


def _as_rows(payloads: torch.Tensor, numel: int, bits: int, group_size: int, name: str) -> torch.Tensor:
    """View ``payloads`` as ``(k, payload_nbytes(numel))`` rows, checking the length."""
    row = _row_nbytes(numel, bits, group_size)
    if payloads.dim() == 2 and payloads.shape[1] == row:
        return payloads
    if payloads.dim() == 1:
        if payloads.numel() != row:
            raise ValueError(
                f"{name} has {payloads.numel()} bytes but numel={numel}, bits={bits}, "
                f"group_size={group_size} needs a payload of {row} bytes"
            )
        return payloads.view(1, row)
    raise ValueError(
        f"{name} must be 1-D ({row} bytes) or 2-D (k, {row}) for numel={numel}, bits={bits}, "
        f"group_size={group_size}; got shape {tuple(payloads.shape)}"
    )


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` (contiguous) as the 1-D, detached tensor the ops take."""
    if x.requires_grad:
        x = x.detach()
    return x if x.dim() == 1 else x.view(-1)


def quantize(
    x: torch.Tensor, bits: int, group_size: GroupSize, *, backend: str | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Quantize ``x`` (any shape, read flat) into one self-contained payload.

    Returns a 1-D ``uint8`` tensor of ``payload_nbytes(x.numel(), bits, group_size)`` bytes.
    """
    if type(x) not in PLAIN_TENSORS or x.dtype not in _FLOAT_DTYPES or not x.is_contiguous():
        _check_float_input(x, "x")  # raises for the exact reason
    numel = x.numel()
    spec, group = _spec(bits, group_size)
    if group is None:
        group = spec.group_size_for(numel)
    device = x.device
    ops = _ops(backend, device)
    result = _output(out, (_row_nbytes(numel, bits, group),), _UINT8, device)
    if numel:
        ops["quantize"](x if x.dim() == 1 and not x.requires_grad else _flat(x), bits, group, result)
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
    if type(payload) not in PLAIN_TENSORS or payload.dtype != _UINT8 or not payload.is_contiguous():
        _check_payloads(payload, "payload")  # raises for the exact reason
    if type(numel) is not int or numel < 0:
        _check_numel(numel)
    spec, group = _spec(bits, group_size)
    if group is None:
        group = spec.group_size_for(numel)
    if dtype not in _FLOAT_DTYPES:
        _check_dtype(dtype, "dtype")
    rows = _as_rows(payload, numel, bits, group, "payload")
    device = payload.device
    ops = _ops(backend, device)
    result = _output(out, (rows.shape[0] * numel,), dtype, device)
    if numel and rows.shape[0]:
        ops["dequantize"](rows, numel, bits, group, result)
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
    if type(parts) is not int or parts < 1:
        raise ValueError(f"parts must be a positive int, got {parts!r}")
    for index, tensor in enumerate(tensors):
        if tensor.numel() % parts:
            raise ValueError(f"x[{index}].numel()={tensor.numel()} is not divisible into parts={parts} equal pieces")
    filled = sum(tensor.numel() for tensor in tensors) // parts
    if part_numel is None:
        return [_flat(t) for t in tensors], filled
    _check_numel(part_numel, "part_numel")
    if part_numel < filled:
        raise ValueError(f"part_numel={part_numel} is shorter than the {filled} elements each part holds")
    return [_flat(t) for t in tensors], part_numel


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
    if type(num_chunks) is not int or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    if numel % num_chunks:
        raise ValueError(f"x.numel()={numel} is not divisible into num_chunks={num_chunks} equal chunks")
    chunk = numel // num_chunks
    group = _group_size(bits, group_size, chunk)
    device = tensors[0].device
    ops = _ops(backend, device)
    result = _output(out, (num_chunks, _row_nbytes(chunk, bits, group)), _UINT8, device)
    if numel:
        ops["reorder_quantize"](tensors, parts, part_numel, perm_t, num_chunks, bits, group, result)
    return result


def _check_requant_chunks(requant_chunks: int, numel: int) -> None:
    if type(requant_chunks) is not int or requant_chunks < 1:
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
    group = _group_size(bits, group_size, numel)
    if out_bits != bits:
        group = max(group, _group_size(out_bits, group_size, numel))
    if payloads.dim() != 2 or payloads.shape[0] < 1:
        raise ValueError(f"payloads must be 2-D (k >= 1, nbytes), got shape {tuple(payloads.shape)}")
    rows = _as_rows(payloads, numel, bits, group, "payloads")
    if isinstance(divide_by, bool) or not isinstance(divide_by, (int, float)) or not divide_by > 0:
        raise ValueError(f"divide_by must be a positive number, got {divide_by!r}")
    device = payloads.device
    ops = _ops(backend, device)
    if requant_chunks is None:
        _check_dtype(dtype, "dtype")
        result = _output(out, (numel,), dtype, device)
        if numel:
            ops["dequant_reduce"](rows, numel, bits, group, float(divide_by), result)
        return result
    _check_requant_chunks(requant_chunks, numel)
    result = _output(out, (requant_chunks, _row_nbytes(numel // requant_chunks, out_bits, group)), _UINT8, device)
    if numel:
        ops["dequant_reduce_requant"](rows, numel, bits, out_bits, group, float(divide_by), result)
    return result
