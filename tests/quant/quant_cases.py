"""Inputs, targets and byte comparisons shared by the quantization tests.

Inputs are built to hit every branch of the wire format. :func:`make_input` gives one kind
per tensor: whole zero groups, magnitudes near the dtype's largest finite value,
subnormals, NaN and Inf, and raw random bit patterns (which cover every float class, NaN
payloads and signed zeros at once). :func:`make_hard_input` fills consecutive groups with a
rotating cast of hard cases, so every size of at least a few groups meets all of them in
one tensor, .5 ties of ``x / scale`` included. :func:`make_payloads` and
:func:`random_payload` give payload rows as a peer could send them, arbitrary bytes included.

A :class:`Target` is a backend on a device (the ``target`` fixtures of ``conftest.py``):
``target.run(op, ...)`` moves the tensor arguments to the device, runs the op with the
backend and brings the result back to the CPU, to be compared with the reference backend
on CPU tensors, the oracle.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

import zcomm.quant as q

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_TAG = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
KINDS = ("normal", "zero_groups", "huge", "tiny", "nonfinite", "random_bits")
HARD_KINDS = 9  # the cases make_hard_input rotates through
_BITS_DTYPE = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


class Target(NamedTuple):
    """A backend running on tensors of one device."""

    backend: str
    device: torch.device

    def __str__(self) -> str:
        return f"{self.backend}-on-{self.device.type}"

    def run(self, op: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        """``op(*args, backend=self.backend, **kwargs)`` on this device; the result on the CPU."""
        moved = [a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args]
        kwargs = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return op(*moved, backend=self.backend, **kwargs).cpu()


def make_input(numel: int, dtype: torch.dtype, kind: str, seed: int, group_size: int = 32) -> torch.Tensor:
    """A 1-D ``dtype`` tensor of ``numel`` elements of the given ``kind`` (see :data:`KINDS`)."""
    gen = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    if kind == "random_bits":
        bits_dtype = _BITS_DTYPE[dtype]
        bits_info = torch.iinfo(bits_dtype)
        raw = torch.randint(bits_info.min, bits_info.max + 1, (numel,), generator=gen, dtype=torch.int64)
        return raw.to(bits_dtype).view(dtype)
    x = torch.randn(numel, generator=gen, dtype=torch.float32)
    if kind == "zero_groups":
        x.view(-1)[: numel // 2] = 0
        x[group_size + 1 :: 2 * group_size] = 0
    elif kind == "huge":
        x = (x / 4).clamp(-1, 1) * info.max
    elif kind == "tiny":
        x = x * info.smallest_normal / 8
    elif kind == "nonfinite":
        for value, stride in ((float("nan"), 97), (float("inf"), 131), (float("-inf"), 211)):
            x[torch.randint(0, stride, (1,), generator=gen).item() :: stride] = value
    return x.to(dtype)


def make_hard_input(numel: int, group_size: int, dtype: torch.dtype, bits: int, seed: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` whose groups cycle through the hard cases: wide-range
    normals, zeros with -0.0, NaN, +Inf, -Inf with NaN, subnormals, values near the dtype's
    max, exact .5 ties of ``x / scale`` (round half to even), and a lone smallest subnormal
    whose scale rounds to 0."""
    gen = torch.Generator().manual_seed(seed)
    info = torch.finfo(dtype)
    index = torch.arange(numel)
    group = index // group_size
    pos = index % group_size  # position inside the group
    length = torch.clamp(numel - group * group_size, max=group_size)  # the group's length
    kind = (group + seed) % HARD_KINDS
    normal = torch.randn(numel, generator=gen)
    mid, after_mid = pos == length // 2, pos == (length // 2 + 1) % length
    qmax = q.QMAX[bits]
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


def random_payload(numel: int, bits: int, group_size: int, seed: int) -> torch.Tensor:
    """Any bytes a peer could send: every code (INT4 -8 included), garbage padding, and scales
    that are negative (so -0 products), subnormal, huge or NaN with a payload."""
    gen = torch.Generator().manual_seed(seed)
    payload = torch.randint(0, 256, (q.payload_nbytes(numel, bits, group_size),), generator=gen, dtype=torch.uint8)
    scales = payload[q.scales_offset(numel, bits) :].view(torch.float32)
    specials = torch.tensor([-0.5, 0.0, -0.0, 1e-45, 3e38, float("inf"), -2.5, float("-inf")])
    scales.copy_(specials[torch.randint(0, specials.numel(), scales.shape, generator=gen)])
    payload[q.scales_offset(numel, bits) :].view(torch.int32)[-1] = 0x7F800001  # a signalling NaN
    return payload


def make_payloads(numel: int, group_size: int, bits: int, k: int, seed: int) -> torch.Tensor:
    """``k`` payload rows: reference quantizations of hard inputs, the last row random bytes.

    Random bytes give arbitrary scales (negative, subnormal, NaN with any payload) and
    codes outside [-qmax, qmax] (INT8 -128, INT4 -8); decoding must still agree.
    """
    inputs = [make_hard_input(numel, group_size, torch.float32, bits, seed + r) for r in range(k - 1)]
    rows = [q.quantize(x, bits, group_size, backend="reference") for x in inputs]
    gen = torch.Generator().manual_seed(seed + 1000)
    rows.append(torch.randint(0, 256, (q.payload_nbytes(numel, bits, group_size),), generator=gen, dtype=torch.uint8))
    return torch.stack(rows)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """``actual`` and ``expected`` hold the same dtype, shape and bytes."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}"
    )
    a, e = byte_view(actual.cpu()), byte_view(expected.cpu())
    diff = (a != e).nonzero().view(-1)
    assert diff.numel() == 0, (
        f"{what}: {diff.numel()} of {a.numel()} bytes differ, first at byte {diff[0].item()}: "
        f"got {a[diff[:8]].tolist()}, expected {e[diff[:8]].tolist()}"
    )


# [Note: stretches] in sources.cuh: cases whose runs of 8 cross every kind of boundary of the
# reordering sources' index arithmetic, on both index paths ([Note: magic division]):
# (parts, widths, part_numel, perm, num_chunks, group_size)
STRETCH_CASES = [
    # slices of 12 (runs cross slice ends), 5 tensors of uneven widths, one empty, a fill of 7
    (3, (5, 13, 0, 40, 7), 72, (17, 3, 0, 9, 12, 1, 16, 5, 8, 2, 15, 4, 11, 6, 14, 7, 10, 13), 3, 24),
    # one tensor and a fill (reduce_scatter_q4's padded slices): pieces end off run boundaries
    (4, (37,), 48, (5, 2, 0, 4, 1, 3), 2, 32),
    # a vector-aligned piece of 15 in a part of 16: a run of 8 that would overrun it by one element
    (4, (15,), 16, (0, 2, 1, 3), 2, 32),
    # widths that are whole runs: every run one vector load; a fill of one run; slices of 88
    (2, (64, 8, 0, 24, 160), 264, (4, 1, 5, 0, 3, 2), 2, 88),
    # a bucket with large and small tensors, groups of 256 held in registers (8-lane teams)
    (4, (1000, 24, 3, 512, 77), 1632, (3, 0, 2, 1), 4, 256),
    # streamed teams (groups past the registers) and the tile scheme, across pieces and the fill
    (2, (3000, 1000, 91), 4096, (1, 0, 3, 2), 2, 2048),
    (2, (5000, 3, 4100), 9112, (1, 0), 2, 9112),
]
