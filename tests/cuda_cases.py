"""Inputs for the CUDA-vs-reference sweeps (host math check and GPU backend tests).

:func:`make_input` fills consecutive groups with a rotating cast of hard cases, so every
size of at least a few groups meets all of them: wide-range normals, zeros with -0.0, NaN,
+Inf, -Inf with NaN, subnormals, values near the dtype's max, exact .5 ties of
``x / scale`` (round half to even), and a lone smallest subnormal whose scale rounds to 0.
"""

from __future__ import annotations

import torch

from zcomm.quant import QMAX, payload_nbytes
from zcomm.quant import quantize as quantize_op

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_TAG = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
KINDS = 9


def _group_values(kind: int, size: int, dtype: torch.dtype, bits: int, gen: torch.Generator) -> torch.Tensor:
    info = torch.finfo(dtype)
    normal = torch.randn(size, generator=gen)
    if kind == 0:
        return normal * torch.exp(3 * torch.randn(size, generator=gen))
    if kind == 1:
        return torch.where(normal > 0, torch.zeros(size), -torch.zeros(size))
    if kind in (2, 3, 4):
        special = {2: (float("nan"),), 3: (float("inf"),), 4: (float("-inf"), float("nan"))}[kind]
        for offset, value in enumerate(special):
            normal[(size // 2 + offset) % size] = value
        return normal
    if kind == 5:
        return normal * info.smallest_normal / 4  # subnormal in the input dtype
    if kind == 6:
        return torch.rand(size, generator=gen).mul(2).sub(1).mul(info.max)
    if kind == 7:
        qmax = QMAX[bits]
        ties = torch.randint(-qmax, qmax, (size,), generator=gen).float() + 0.5
        ties[0] = qmax  # absmax = qmax, so scale = 1 and x / scale is the tie itself
        return ties
    lone = torch.zeros(size)
    lone[size // 3] = info.smallest_normal * info.eps  # the smallest subnormal
    return lone


def make_input(numel: int, group_size: int, dtype: torch.dtype, bits: int, seed: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` whose groups cycle through the hard cases."""
    gen = torch.Generator().manual_seed(seed)
    parts, done, kind = [], 0, seed % KINDS
    while done < numel:
        size = min(group_size, numel - done)
        parts.append(_group_values(kind, size, dtype, bits, gen).to(dtype))
        done += size
        kind = (kind + 1) % KINDS
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)


def make_payloads(numel: int, group_size: int, bits: int, k: int, seed: int) -> torch.Tensor:
    """``k`` payload rows: reference quantizations of hard inputs, the last row random bytes.

    Random bytes give arbitrary scales (negative, subnormal, NaN with any payload) and
    codes outside [-qmax, qmax] (INT8 -128, INT4 -8); decoding must still agree.
    """
    rows = [
        quantize_op(make_input(numel, group_size, torch.float32, bits, seed + r), bits, group_size, backend="reference")
        for r in range(k - 1)
    ]
    gen = torch.Generator().manual_seed(seed + 1000)
    rows.append(torch.randint(0, 256, (payload_nbytes(numel, bits, group_size),), generator=gen, dtype=torch.uint8))
    return torch.stack(rows)
