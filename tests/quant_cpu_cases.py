"""Inputs and byte comparisons shared by the quantization tests of the ``cpu`` backend.

Inputs are built to hit every branch of the wire format: whole zero groups, magnitudes near
the dtype's largest finite value, subnormals, NaN and Inf, and raw random bit patterns
(which cover every float class, NaN payloads and signed zeros at once).
"""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KINDS = ("normal", "zero_groups", "huge", "tiny", "nonfinite", "random_bits")
_BITS_DTYPE = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


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


def byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """``actual`` and ``expected`` hold the same dtype, shape and bytes."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (
        f"{what}: {actual.dtype}{tuple(actual.shape)} != {expected.dtype}{tuple(expected.shape)}"
    )
    a, e = byte_view(actual), byte_view(expected)
    diff = (a != e).nonzero().view(-1)
    assert diff.numel() == 0, (
        f"{what}: {diff.numel()} of {a.numel()} bytes differ, first at byte {diff[0].item()}: "
        f"got {a[diff[:8]].tolist()}, expected {e[diff[:8]].tolist()}"
    )
