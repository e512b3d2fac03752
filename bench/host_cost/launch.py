"""Launch cost on the host, without a GPU: the Python side of one kernel launch, per launcher.

``python -m bench.host_cost --launch-stand-in [--calls N]`` times :func:`zcomm_cuda.loader.launch`
for argument tuples shaped like the cuda backend's kernels (:data:`CASES`), every GPU-side call
replaced by a stand-in (what each figure leaves out: docs/benchmarks.md): ``driver`` runs the whole
driver launcher into a C no-op of ``cuLaunchKernelEx``'s signature compiled here with ``cc``;
``cupy`` runs zcomm's side of the cupy launcher up to cupy's ``Function`` call, a Python no-op here.
torch's raw stream and the current device come from C builtins returning 0 in both, so the rows
differ by the launchers' own work only. Each figure is the median of ``ROUNDS`` rounds of
``--calls`` calls, the columns taking turns; ``pack``, ``ctypes call`` and ``empty call`` (the
timing loop's own cost) are parts of the driver row, ``11-argument call`` the no-op called as
``cuLaunchKernel`` would be ([Note: launch entry point] in :mod:`zcomm_cuda.driver_launch`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from bench.harness.table import markdown
from bench.harness.timing import per_call_seconds
from zcomm_cuda import driver_launch, loader

ROUNDS = 9
DEVICE = torch.device("cuda", 0)
_P, _I = 0x7F00_0000_0000, np.int64(1 << 20)  # an address goes as a Python int ([Note: launch arguments])
# kernel -> (source, PTX parameter types, arguments) shaped like the cuda backend's launches
CASES: dict[str, tuple[str, tuple[str, ...], tuple[Any, ...]]] = {
    "zc_quantize_bf16_int8": ("quantize.cu", ("u64", "u64", "u64", "u64", "u64", "u32"),
                              (_P, _I, np.int64(256), _P, 0, np.int32(0))),
    "zc_dequantize_bf16_int8": ("dequantize.cu", ("u64",) * 6, (_P, _I, _I, np.int64(256), np.int64(4), _P)),
    "zc_dequant_reduce_bf16_int4": ("dequant_reduce.cu", ("u64",) * 5 + ("f32", "u64"),
                                    (_P, _I, _I, np.int64(256), np.int64(4), np.float32(4.0), _P)),
    "zc_reorder_interleaved_bf16_int4": ("reorder_quantize.cu", ("u64",) * 11 + ("u32",),
                                         (_P, np.int64(4), _I, _P, _I, _I, np.int64(4), np.int64(256), _I, _P,
                                          0, np.int32(0))),
}  # fmt: skip
NOOP_C = (
    "int zc_noop_launch(void *config, void *function, void **params, void **extra) { return 0; }\n"
    "int zc_noop_launch11(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,\n"
    "                     unsigned shared, void *stream, void **params, void **extra) { return 0; }\n"
)


def _noop_library(workdir: str) -> ctypes.CDLL:
    """A shared library with one C function of ``cuLaunchKernelEx``'s signature that returns 0."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("bench.host_cost --launch-stand-in needs a C compiler (cc or gcc) for its no-op cuLaunchKernelEx")
    source, library = Path(workdir) / "noop.c", Path(workdir) / "libnoop.so"
    source.write_text(NOOP_C)
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return ctypes.CDLL(str(library))


@contextlib.contextmanager
def _stand_ins(noop: ctypes.CDLL) -> Iterator[driver_launch.Driver]:
    """The loader's GPU-side lookups replaced for the duration (restored after); yields the stand-in driver,
    whose every function is the C no-op (the launch is the only one called here)."""
    names = ("cuLaunchKernelEx", "cuGetErrorString", "cuGetErrorName", "cuCtxGetCurrent", "cuCtxSetCurrent",
             "cuCtxGetDevice", "cuDeviceGet", "cuDevicePrimaryCtxRetain")  # fmt: skip
    # each name a function object of its own: Driver sets their argtypes
    driver = driver_launch.Driver(types.SimpleNamespace(**{name: noop["zc_noop_launch"] for name in names}))
    driver.ensure_context = lambda device: None  # no context to make current without a GPU
    kernels = {(source, name, 0): driver_launch.DriverKernel(name=name, function=0, params=params, device=0,
                                                             driver=driver)
               for name, (source, params, _) in CASES.items()}  # fmt: skip

    def cupy_call(grid: tuple, block: tuple, args: tuple, shared: int, stream: Any) -> None:
        pass

    saved = {name: getattr(loader, name) for name in ("_DRIVER_KERNELS", "kernel", "current_raw_stream",
                                                      "_current_device", "_STREAMS", "_use_driver")}  # fmt: skip
    loader._DRIVER_KERNELS = kernels
    loader.kernel = functools.lru_cache(maxsize=None)(lambda source, name, index: cupy_call)
    loader.current_raw_stream = abs  # abs(0): the handle 0, from a C builtin as torch's is
    loader._current_device = int  # int(): device 0, from a C builtin as cupy's getDevice is
    loader._STREAMS = {(0, 0): object()}
    try:
        yield driver
    finally:
        for name, value in saved.items():
            setattr(loader, name, value)


def _launch_with(launcher: str, source: str, name: str, args: tuple) -> Callable[[], None]:
    def call() -> None:
        loader._use_driver = launcher == "driver"  # set_launcher without its validation, inside the timing
        loader.launch(source, name, DEVICE, 1056, 256, args)

    return call


def measure(calls: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as workdir:
        library = _noop_library(workdir)
        with _stand_ins(library) as driver:
            noop = driver.launch_kernel_ex
            eleven = library["zc_noop_launch11"]  # called as cuLaunchKernel would be
            eleven.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            eleven.restype = ctypes.c_int
            rows = []
            for name, (source, _, args) in CASES.items():
                target = loader._DRIVER_KERNELS[(source, name, 0)]
                target.launch(1056, 256, 0, args)  # this thread's block
                block = target.block()
                timed = per_call_seconds({
                    "cupy us": _launch_with("cupy", source, name, args),
                    "driver us": _launch_with("driver", source, name, args),
                    "pack us": lambda: block.write(1056, 256, 0, args),  # noqa: B023 (called in this iteration)
                    "ctypes call us": lambda: noop(1, 0, 1, None),
                    "11-argument call us": lambda: eleven(0, 1056, 1, 1, 256, 1, 1, 0, 0, 1, None),
                    "empty call us": lambda: None,
                }, rounds=ROUNDS, repeat=calls)  # fmt: skip
                rows.append({"kernel": name, "arguments": len(args),
                             **{column: statistics.median(seconds) * 1e6 for column, seconds in timed.items()}})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_cost --launch-stand-in", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10000, help=f"launches per round ({ROUNDS} rounds, the median)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows = [{**row, "driver/cupy*": row["driver us"] / row["cupy us"]} for row in measure(args.calls)]
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, python {platform.python_version()}"
    print(f"# launch cost, Python side, no GPU ({machine}); us per launch, median of {ROUNDS} x {args.calls}")
    print("\n".join(markdown(rows)))
    print("# cupy us: zcomm's side only, up to a no-op in place of cupy's Function call (cupy's own work is not in "
          "it); driver us: all of the launcher but the driver's work inside libcuda")  # fmt: skip
    print(f"# load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"# {time.perf_counter() - started:.1f} s")
    return 0
