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


def make_input(numel: int, group_size: int, dtype: torch.dtype, bits: int, seed: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` whose groups cycle through the hard cases."""
    gen = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    index = torch.arange(numel)
    group = index // group_size
    pos = index % group_size  # position inside the group
    length = torch.clamp(numel - group * group_size, max=group_size)  # the group's length
    kind = (group + seed) % KINDS
    normal = torch.randn(numel, generator=gen)
    mid, after_mid = pos == length // 2, pos == (length // 2 + 1) % length
    qmax = QMAX[bits]
    nan, inf = float("nan"), float("inf")
    cases = [
        normal * torch.exp(3 * torch.randn(numel, generator=gen)),
        torch.where(normal > 0, 0.0, -0.0),
        torch.where(mid, nan, normal),
        torch.where(mid, inf, normal),
        torch.where(mid, -inf, torch.where(after_mid, nan, normal)),
        normal * info.smallest_normal / 4,  # subnormal in the input dtype
        torch.rand(numel, generator=gen).mul(2).sub(1).mul(info.max),
        # absmax = qmax makes scale = 1, so x / scale is the .5 tie itself
        torch.where(pos == 0, float(qmax), torch.randint(-qmax, qmax, (numel,), generator=gen) + 0.5),
        torch.where(pos == length // 3, info.smallest_normal * info.eps, 0.0),  # a lone smallest subnormal
    ]
    values = torch.zeros(numel)
    for k, case in enumerate(cases):
        values = torch.where(kind == k, case.float(), values)
    return values.to(dtype)


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
