"""Which compute precision a benchmark uses on this machine, and why; the CPU's model name.

A CPU without native bf16 emulates bf16 matmuls, so every bf16 step there is compute-bound and
hides what communication costs (``bench/PERFORMANCE.md``). ``auto`` therefore picks bf16 on a GPU
that supports it and on a CPU whose ``/proc/cpuinfo`` flags name native bf16 (on every
processor), and fp32 everywhere else; every implementation in a run uses the same choice, and
every rank: bf16 only when every rank's hardware has it (:func:`agreed_precision`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

CPUINFO = Path("/proc/cpuinfo")
# Linux's names for the CPU features that execute bf16 dot products natively (x86: AMX
# tiles, AVX512 VDPBF16PS; arm64: the BF16 extension).
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")
DTYPE_CHOICES = ("auto", "bf16", "fp32")


class Precision(NamedTuple):
    dtype: str  # bf16 or fp32
    reason: str


def read_cpuinfo() -> str:
    """The text of ``/proc/cpuinfo``, or "" where there is none."""
    try:
        return CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _fields(cpuinfo: str, key: str) -> list[str]:
    lines = (line.partition(":") for line in cpuinfo.splitlines())
    return [value.strip() for name, sep, value in lines if sep and name.strip() == key]


def cpu_model(cpuinfo: str) -> str:
    """The first processor's model name (``model name``, or arm64's ``CPU part``), else "unknown CPU"."""
    for key in ("model name", "Model", "CPU part"):
        values = _fields(cpuinfo, key)
        if values and values[0]:
            return values[0]
    return "unknown CPU"


def native_bf16_flags(cpuinfo: str) -> list[str]:
    """The native-bf16 feature flags that every processor listed in ``cpuinfo`` has."""
    flag_lines = _fields(cpuinfo, "flags") or _fields(cpuinfo, "Features")
    if not flag_lines:
        return []
    common = set.intersection(*(set(line.split()) for line in flag_lines))
    return [flag for flag in NATIVE_BF16_FLAGS if flag in common]


def choose_precision(requested: str, *, cpuinfo: str, cuda_bf16: bool | None) -> Precision:
    """``bf16`` and ``fp32`` as given; ``auto`` from ``cuda_bf16`` on a GPU run (whether the GPU computes
    in bf16; None on a CPU run), else from ``cpuinfo``'s flags."""
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {requested!r}")
    if requested != "auto":
        return Precision(requested, f"{requested} as asked (--dtype {requested})")
    if cuda_bf16 is not None:
        if cuda_bf16:
            return Precision("bf16", "auto: the GPU computes in bf16 natively")
        return Precision("fp32", "auto: the GPU has no native bf16")
    model = cpu_model(cpuinfo)
    flags = native_bf16_flags(cpuinfo)
    if flags:
        return Precision("bf16", f"auto: {model} has native bf16 ({', '.join(flags)})")
    names = "/".join(NATIVE_BF16_FLAGS[:2])
    return Precision("fp32", f"auto: {model} has no native bf16 (no {names} flag), so bf16 would be emulated")


def agreed_precision(requested: str, device: Any) -> Precision:
    """:func:`choose_precision` on every rank (on ``device``); bf16 only if every rank's hardware has it (collective)."""
    import torch
    import torch.distributed as dist

    from .timing import reduce_over_ranks

    cuda_bf16 = torch.cuda.is_bf16_supported() if device.type == "cuda" else None
    local = choose_precision(requested, cpuinfo=read_cpuinfo(), cuda_bf16=cuda_bf16)
    (everywhere,) = reduce_over_ranks([float(local.dtype == "bf16")], dist.ReduceOp.MIN, device=device)
    if local.dtype == "bf16" and not everywhere:
        return Precision("fp32", f"auto: another rank's hardware has no native bf16 (here: {local.reason})")
    return local
