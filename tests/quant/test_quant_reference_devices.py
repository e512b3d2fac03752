"""The ``reference`` backend computes the wire format's bytes on every device.

[Note: true division on CUDA] in :mod:`zcomm.quant.backends.reference`: ATen's CUDA kernel
turns ``tensor / cpu_scalar`` (a Python number included) into a multiplication by the
reciprocal, so the reference must divide only by tensors on the dividend's device. This
check needs no GPU: it runs the backend's kernels on ``meta`` tensors (the same Python
code, no data) under a dispatch mode that sees every aten call: every division of a non-CPU
tensor must have a tensor divisor on the same device, and nothing may read a value back to
the host (``.item()``/``bool()`` raise on meta). On a GPU, the ``reference-on-cuda`` target of
test_quant_vs_reference.py compares the CUDA bytes with the CPU ones. Here the scale is
checked against numpy's IEEE fp32 division on inputs where the reciprocal product rounds
differently.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zcomm.quant as q
from zcomm.quant.backends import reference
from zcomm.quant.wire_format import QMAX, payload_nbytes

DIVISIONS = {"aten.div.Tensor", "aten.div_.Tensor", "aten.div.Scalar", "aten.div_.Scalar", "aten.true_divide.Tensor"}


class _DivisionAudit(TorchDispatchMode):
    """Records divisions of a non-CPU tensor by anything but a tensor on its own device."""

    def __init__(self) -> None:
        super().__init__()
        self.divisions = 0
        self.violations: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) in DIVISIONS:
            self.divisions += 1
            dividend, divisor = args[0], args[1]
            if dividend.device.type != "cpu" and not (
                isinstance(divisor, torch.Tensor) and divisor.device == dividend.device
            ):
                where = divisor.device if isinstance(divisor, torch.Tensor) else type(divisor).__name__
                self.violations.append(f"{func}: {dividend.device} tensor / {where} divisor")
        return func(*args, **(kwargs or {}))


def _run_every_kernel(device: str) -> None:
    """Each reference kernel once, INT8 and INT4, with a divisor != 1 for dequant_reduce."""
    x = torch.empty(1000, dtype=torch.bfloat16, device=device)
    for bits in (8, 4):
        payload = torch.empty(payload_nbytes(1000, bits, 64), dtype=torch.uint8, device=device)
        reference.quantize(x, bits, 64, payload)
        reference.dequantize(payload.view(1, -1), 1000, bits, 64, torch.empty_like(x))
        rows = torch.empty(2, payload_nbytes(500, bits, 64), dtype=torch.uint8, device=device)
        reference.reorder_quantize([x], 1, 1000, (1, 0, 3, 2), 2, bits, 64, rows)
        filled = torch.empty(2, payload_nbytes(520, bits, 64), dtype=torch.uint8, device=device)
        reference.reorder_quantize([x[:600], x[600:]], 2, 520, (1, 0, 3, 2), 2, bits, 64, filled)
        out = torch.empty(500, dtype=torch.float16, device=device)
        reference.dequant_reduce(rows, 500, bits, 64, 3.0, out)
        for out_bits in (8, 4):
            requant = torch.empty(2, payload_nbytes(250, out_bits, 64), dtype=torch.uint8, device=device)
            reference.dequant_reduce_requant(rows, 500, bits, out_bits, 64, 3.0, requant)


def test_reference_divides_only_by_tensors_on_the_dividends_device():
    with _DivisionAudit() as audit:
        _run_every_kernel("meta")
    assert audit.divisions > 0, "the audit saw no division: it checks nothing"
    assert audit.violations == []


def test_reference_scale_is_the_ieee_fp32_division():
    # absmax values for which x * fl(1/127) != fl(x / 127) in fp32 (found by search below)
    candidates = np.random.default_rng(0).uniform(1, 2, 20000).astype(np.float32)
    reciprocal = candidates * (np.float32(1) / np.float32(QMAX[8]))
    divided = candidates / np.float32(QMAX[8])
    differ = candidates[reciprocal != divided][:64]
    assert differ.size > 0
    x = torch.zeros(differ.size * 32)
    x.view(-1, 32)[:, 0] = torch.from_numpy(differ)
    payload = q.quantize(x, 8, 32, backend="reference")
    scales = payload[q.scales_offset(x.numel(), 8) :].view(torch.float32).numpy()
    np.testing.assert_array_equal(scales, differ / np.float32(QMAX[8]))
