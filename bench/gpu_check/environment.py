"""What machine and software a gpu-check ran on: GPUs, driver, CUDA, torch, cupy, NCCL, CPU.

Every probe is read-only and tolerant: a tool or package that is absent gives ``"absent"``
or the error, never an exception, because the environment section of a failed check is the
part a reader needs most.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

ABSENT = "absent"


def _probe(fn: Callable[[], str]) -> str:
    try:
        return fn()
    except Exception as exc:  # a probe reports what failed; it never stops the report
        return f"error: {type(exc).__name__}: {exc}"


def _command(argv: list[str]) -> str:
    if shutil.which(argv[0]) is None:
        return f"{argv[0]} not found"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        return f"{argv[0]} failed: {done.stderr.strip()}"
    return (done.stdout.strip() or done.stderr.strip()).splitlines()[-1]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ABSENT


def _cuda_version(encoded: int) -> str:
    """CUDA's ``1000 * major + 10 * minor`` as ``major.minor``."""
    return f"{encoded // 1000}.{encoded % 1000 // 10}"


def _gpus() -> str:
    import torch

    names = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        names.append(f"cuda:{index} {props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB, "
                     f"{props.multi_processor_count} SMs)")  # fmt: skip
    return "; ".join(names) or "none"


def _cupy() -> str:
    cupy = importlib.import_module("cupy")
    runtime = cupy.cuda.runtime
    nvrtc = ".".join(map(str, cupy.cuda.nvrtc.getVersion()))
    return (f"cupy {cupy.__version__} (CUDA runtime {_cuda_version(runtime.runtimeGetVersion())}, "
            f"driver API {_cuda_version(runtime.driverGetVersion())}, NVRTC {nvrtc})")  # fmt: skip


def _nccl() -> str:
    import torch

    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _cpu() -> str:
    model = platform.processor() or "?"
    if shutil.which("lscpu"):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), model)
    return f"{model}, {os.cpu_count()} logical CPUs"


def _checkout(repo: Path) -> str:
    if shutil.which("git") is None:
        return "git not on PATH"
    head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    if head.returncode:
        return f"not a git checkout ({head.stderr.strip()})"
    dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True, check=False)
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def collect(repo: Path) -> dict[str, str]:
    """The environment as ``{label: value}``, in report order."""
    import torch

    return {
        "GPU": _probe(_gpus),
        "driver": _probe(lambda: _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])),
        "torch": f"{torch.__version__} (CUDA {torch.version.cuda})",
        "NCCL (torch)": _probe(_nccl),
        "cupy": _probe(_cupy) if importlib.util.find_spec("cupy") else ABSENT,
        "nvcc": _probe(lambda: _command([shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc", "--version"])),
        "python": f"{platform.python_version()} ({sys.executable})",
        "numpy / numba / pytest": " / ".join(_version(p) for p in ("numpy", "numba", "pytest")),
        "CPU": _probe(_cpu),
        "OS": platform.platform(),
        "checkout": _probe(lambda: _checkout(repo)),
    }


def collect_cpu(repo: Path) -> dict[str, str]:
    """What a run without a GPU reports: torch, python, CPU, checkout."""
    import torch

    return {"torch": torch.__version__, "python": platform.python_version(), "CPU": _probe(_cpu),
            "checkout": _probe(lambda: _checkout(repo))}
