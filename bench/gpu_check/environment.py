"""What machine and software a GPU run ran on: GPUs, driver, CUDA, torch, cupy, NCCL, CPU, checkout.

Every probe is read-only and tolerant: an absent tool or package gives a line saying so or the
error, never an exception, because the environment of a failed check is what a reader needs most.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable


def _probe(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception as exc:  # a probe reports what failed; it never stops the report
        return f"error: {type(exc).__name__}: {exc}"


def _command(*argv: str) -> str:
    """The last line a command printed, or why there is none."""
    if shutil.which(argv[0]) is None:
        return f"{argv[0]} not found"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        return f"{argv[0]} failed: {done.stderr.strip()}"
    return (done.stdout.strip() or done.stderr.strip()).splitlines()[-1]


def _gpus() -> str:
    import torch

    props = [torch.cuda.get_device_properties(index) for index in range(torch.cuda.device_count())]
    return "; ".join(f"cuda:{i} {p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
                     f"{p.multi_processor_count} SMs)" for i, p in enumerate(props)) or "none"  # fmt: skip


def _cupy() -> str:
    if importlib.util.find_spec("cupy") is None:
        return "absent"
    import cupy

    def cuda(encoded: int) -> str:  # CUDA's 1000 * major + 10 * minor
        return f"{encoded // 1000}.{encoded % 1000 // 10}"

    runtime = cupy.cuda.runtime
    return (f"cupy {cupy.__version__} (CUDA runtime {cuda(runtime.runtimeGetVersion())}, driver API "
            f"{cuda(runtime.driverGetVersion())}, NVRTC {'.'.join(map(str, cupy.cuda.nvrtc.getVersion()))})")  # fmt: skip


def _cpu() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout if shutil.which("lscpu") else ""
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), None)
    return f"{model or platform.processor() or '?'}, {os.cpu_count()} logical CPUs"


def _checkout(repo: Path) -> str:
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    if head.returncode:
        return f"not a git checkout ({head.stderr.strip()})"
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True, check=False)
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def collect(repo: Path, gpu: bool = True) -> dict[str, str]:
    """The environment as ``{label: value}``, in report order; without a GPU: torch, python, CPU, checkout."""
    import torch

    probes = {
        "GPU": _gpus,
        "driver": lambda: _command("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
        "torch": lambda: f"{torch.__version__} (CUDA {torch.version.cuda})",
        "NCCL (torch)": lambda: ".".join(map(str, torch.cuda.nccl.version())),
        "cupy": _cupy,
        "nvcc": lambda: _command(shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc", "--version"),
        "python": lambda: f"{platform.python_version()} ({sys.executable})",
        "numpy / numba / pytest": lambda: " / ".join(importlib.metadata.version(p) if importlib.util.find_spec(p) else "absent"
                                                     for p in ("numpy", "numba", "pytest")),
        "CPU": _cpu,
        "OS": platform.platform,
    } if gpu else {"torch": lambda: torch.__version__, "python": platform.python_version, "CPU": _cpu}
    probes["checkout"] = lambda: _checkout(repo) if shutil.which("git") else "git not on PATH"
    return {label: _probe(fn) for label, fn in probes.items()}
