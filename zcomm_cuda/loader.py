"""Run-time compilation of the ``.cu`` sources with NVRTC, a disk cache of it, and launches on torch's stream.

Each source in ``kernels/`` is compiled by :func:`compile_source` (NVRTC through
``cupy.cuda.nvrtc``, with :func:`nvrtc_options` and the device's architecture, nothing else)
at most once per machine: :func:`load_or_compile` keeps NVRTC's output in the disk cache
([Note: kernel cache] in _disk_cache.py; ``$ZCOMM_CACHE_DIR``, else ``$XDG_CACHE_HOME/zcomm``
or ``~/.cache/zcomm``), which ``python -m zcomm_cuda.build`` fills ahead of time. A process loads each source's module once
per device (``cupy.cuda.function.Module``) and looks its kernels up by their ``extern "C"``
names: on first use, or all at once when a plan calls :func:`prepare`, so that no compile and
no load happens between a collective's hops. :func:`compile_count` and
:data:`COMPILE_HOOKS` let a test watch for compiles. cupy is imported inside the functions, so
this module imports on machines without it.

[Note: why not cupy.RawModule] RawModule compiles through cupy's cached path, which appends
``-ftz=true`` after the caller's options (NVRTC takes the last value) and keys its disk
cache on the source text and options only. The kernels' wire-format arithmetic is immune
to that flag (see [Note: explicit rounding] in wire_math.cuh), but a compile that adds
options of its own could not be checked without a GPU, as it queries the device for the
architecture. :func:`compile_source` runs with exactly the options it is given, on any
machine with an NVRTC library, so tests/quant/test_cuda_compile.py checks the PTX of the very
function the loader runs, hostile flags included; the disk cache stores its output, keyed by
those options, the arch, the expanded source and NVRTC's version.

[Note: device checks] A kernel that checks an invariant on the device can only ``__trap()``,
a sticky error that kills the rank's CUDA context while its peers wait in a collective. So
the kernels check nothing on the device by default: the launchers check the invariants on
the host before launching. ``ZC_DEVICE_CHECK(cond)`` (wire_math.cuh) traps only in a compile
with ``-DZCOMM_DEVICE_CHECKS=1``, which :func:`nvrtc_options` adds when
``$ZCOMM_CUDA_DEVICE_CHECKS=1`` (read once per process; ``0`` or unset: off; any other value
raises ``ValueError``). gpu-check turns it on; such a compile has entries of its own in the
disk cache.
"""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch

from . import _disk_cache, driver_launch

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
# by compile time, longest first (about 17, 13, 4, 2 and 1 CPU seconds for sm_90 with NVRTC 13.0):
# :func:`fill` starts the compiles in this order, so that the long ones do not come last
KERNEL_SOURCES = ("dequant_reduce_requant.cu", "reorder_quantize.cu", "dequant_reduce.cu", "quantize.cu",
                  "dequantize.cu")

# The wire format forbids FMA contraction, flush-to-zero and approximate division. The
# kernels do not depend on these options for it (see [Note: explicit rounding] in
# wire_math.cuh); they keep any other float code honest as well.
NVRTC_OPTIONS = ("-std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true", "--prec-sqrt=true")

# $ZCOMM_CUDA_DEVICE_CHECKS and the define it adds (see [Note: device checks])
DEVICE_CHECKS_ENV = "ZCOMM_CUDA_DEVICE_CHECKS"
DEVICE_CHECKS_DEFINE = "-DZCOMM_DEVICE_CHECKS=1"
_device_checks: bool | None = None  # None until $ZCOMM_CUDA_DEVICE_CHECKS is read

_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\s*$")


class CompiledSource(NamedTuple):
    """What NVRTC produced for one source: PTX text, and a cubin for a real (``sm_``) arch."""

    ptx: str
    cubin: bytes | None


def expand_includes(path: Path, seen: set[Path] | None = None) -> str:
    """``path``'s text with every local ``#include "..."`` inlined once (``#pragma once``).

    NVRTC then needs no include paths: the source is one self-contained translation unit.
    """
    seen = set() if seen is None else seen
    seen.add(path)
    lines = []
    for line in path.read_text().splitlines():
        match = _LOCAL_INCLUDE.match(line)
        if match:
            header = (path.parent / match.group(1)).resolve()
            if header not in seen:
                lines.append(expand_includes(header, seen))
        elif not _PRAGMA_ONCE.match(line):
            lines.append(line)
    return "\n".join(lines) + "\n"


def device_checks() -> bool:
    """Whether this process compiles the kernels' device checks ([Note: device checks]).

    Reads $ZCOMM_CUDA_DEVICE_CHECKS on the first call: unset, empty or ``0`` is off, ``1`` on;
    any other value raises ``ValueError``.
    """
    global _device_checks
    if _device_checks is None:
        value = os.environ.get(DEVICE_CHECKS_ENV, "")
        if value not in ("", "0", "1"):
            raise ValueError(f"${DEVICE_CHECKS_ENV} is {value!r}: it is 1 (compile the kernels' device checks) "
                             f"or 0 (do not)")  # fmt: skip
        _device_checks = value == "1"
    return _device_checks


def nvrtc_options() -> tuple[str, ...]:
    """The options the loader compiles with: :data:`NVRTC_OPTIONS`, and the device checks' define
    when they are on ([Note: device checks])."""
    return (*NVRTC_OPTIONS, DEVICE_CHECKS_DEFINE) if device_checks() else NVRTC_OPTIONS


# Called as hook(source, arch, options) before each NVRTC compile of this process; a test
# appends one to see (or forbid) compiles, e.g. between a collective's hops.
COMPILE_HOOKS: list[Callable[[str, str, tuple[str, ...]], None]] = []
_compiles = 0
_compiles_lock = threading.Lock()


def compile_count() -> int:
    """How many NVRTC compiles this process has run (:func:`compile_source` calls)."""
    return _compiles


def compile_source(source: str, arch: str, options: Sequence[str] = NVRTC_OPTIONS) -> CompiledSource:
    """Compile ``kernels/<source>`` with NVRTC for ``arch`` (``"sm_90"`` or ``"compute_90"``).

    The options are exactly ``options`` followed by ``-arch=<arch>``. Needs cupy and an NVRTC
    library, no GPU. Raises ``RuntimeError`` with NVRTC's log when the compile fails. Every
    compile of the loader, the disk cache's included, is a call of this function.
    """
    from cupy.cuda import nvrtc

    global _compiles
    options = tuple(options)
    for hook in tuple(COMPILE_HOOKS):
        hook(source, arch, options)
    with _compiles_lock:
        _compiles += 1
    program = nvrtc.createProgram(expand_includes(KERNEL_DIR / source), source, (), ())
    try:
        try:
            nvrtc.compileProgram(program, (*options, f"-arch={arch}"))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program)
            raise RuntimeError(f"NVRTC could not compile {source} for {arch}: {exc}\n{log}") from exc
        ptx = nvrtc.getPTX(program)
        cubin = nvrtc.getCUBIN(program) if arch.startswith("sm_") else None
    finally:
        nvrtc.destroyProgram(program)
    return CompiledSource(ptx.decode() if isinstance(ptx, bytes) else ptx, cubin)


def load_or_compile(source: str, arch: str, options: Sequence[str] | None = None,
                    directory: Path | None = None) -> _disk_cache.Fetched:
    """``source`` compiled for ``arch``: from the disk cache, or by :func:`compile_source` and then stored
    there ([Note: kernel cache]). ``options`` default to :func:`nvrtc_options`, ``directory`` to
    :func:`~zcomm_cuda._disk_cache.cache_dir`."""
    from cupy.cuda import nvrtc

    options = nvrtc_options() if options is None else tuple(options)
    directory = _disk_cache.cache_dir() if directory is None else directory
    text = expand_includes(KERNEL_DIR / source)
    fetched = _disk_cache.load_or_compile(directory, source, text, options, arch, nvrtc.getVersion(),
                                          lambda: _disk_cache.Entry(*compile_source(source, arch, options)))
    return fetched._replace(entry=CompiledSource(*fetched.entry))


class Filled(NamedTuple):
    """One job of :func:`fill`: ``source`` for ``arch``, as fetched, and the seconds it took: on the
    clock, and on the CPU (its thread's, where NVRTC runs: the work, whatever else the machine runs)."""

    source: str
    arch: str
    fetched: _disk_cache.Fetched
    seconds: float
    cpu_seconds: float


def fill(sources: Iterable[str], archs: Iterable[str], options: Sequence[str] | None = None,
         directory: Path | None = None, workers: int | None = None) -> list[Filled]:
    """:func:`load_or_compile` of every source for every arch, in threads (NVRTC compiles without the
    GIL, and its programs are independent), the longest compiles first (:data:`KERNEL_SOURCES`'s
    order); the results in that order. ``workers`` defaults to the CPUs this process may run on."""
    order = {source: i for i, source in enumerate(KERNEL_SOURCES)}
    wanted = sorted(dict.fromkeys(sources), key=lambda source: order.get(source, len(order)))
    jobs = [(source, arch) for source in wanted for arch in dict.fromkeys(archs)]
    workers = workers or len(os.sched_getaffinity(0))

    def run(job: tuple[str, str]) -> Filled:
        start, cpu_start = time.perf_counter(), time.thread_time()
        fetched = load_or_compile(*job, options, directory)
        return Filled(*job, fetched, time.perf_counter() - start, time.thread_time() - cpu_start)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(jobs)))) as pool:
        return list(pool.map(run, jobs))


def target_arch(capability: tuple[int, int], supported: Sequence[int]) -> str:
    """The ``-arch`` for a device of compute ``capability`` given NVRTC's ``supported`` archs.

    A cubin for the device itself when NVRTC knows it; for a device newer than NVRTC, PTX for
    the newest older arch NVRTC knows (the driver compiles it for the device at load time).
    """
    cc = 10 * capability[0] + capability[1]
    if cc in supported:
        return f"sm_{cc}"
    older = [arch for arch in supported if arch < cc]
    if not older:
        raise RuntimeError(f"NVRTC supports archs {sorted(supported)}, none of them runs on compute capability {cc}")
    return f"compute_{max(older)}"


def device_arch(device_index: int) -> str:
    """The ``-arch`` the loader compiles for on device ``device_index`` (:func:`target_arch`)."""
    from cupy.cuda import nvrtc

    return target_arch(torch.cuda.get_device_capability(device_index), nvrtc.getSupportedArchs())


# (source, device index) -> the PTX that was loaded; the driver launcher reads its kernels' parameters
_PTX: dict[tuple[str, int], str] = {}


@lru_cache(maxsize=None)
def _module(source: str, device_index: int) -> Any:
    import cupy

    compiled = load_or_compile(source, device_arch(device_index)).entry
    module = cupy.cuda.function.Module()
    with cupy.cuda.Device(device_index):
        module.load(compiled.cubin if compiled.cubin is not None else compiled.ptx.encode())
    _PTX[(source, device_index)] = compiled.ptx
    return module


def prepare(kernels: Iterable[tuple[str, str]], device_index: int) -> None:
    """Compile or load, load and look up every ``(source, name)`` kernel for device ``device_index`` now.

    A plan calls it when it is made, so that its collectives' launches (:func:`kernel`,
    :func:`launch`) find everything resolved and no compile or module load happens between
    their hops; a missing source, a failed compile or an unknown kernel name raises here. The
    sources not loaded yet are compiled (or read from the disk cache) and loaded in parallel
    threads, as :func:`fill` does.
    """
    wanted = list(kernels)
    load_modules((source for source, _ in wanted), device_index)
    for source, name in wanted:
        kernel(source, name, device_index)


def load_modules(sources: Iterable[str], device_index: int) -> None:
    """Compile (or read from the disk cache) and load each of ``sources`` for device ``device_index``
    now, the sources not loaded yet in parallel threads, as :func:`fill` does; a failure raises here."""
    sources = list(dict.fromkeys(sources))
    if len(sources) == 1:
        _module(sources[0], device_index)
    elif sources:
        workers = max(1, min(len(sources), len(os.sched_getaffinity(0))))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for _ in pool.map(lambda source: _module(source, device_index), sources):
                pass


@lru_cache(maxsize=None)
def _ptx_params(source: str, device_index: int) -> dict[str, tuple[str, ...]]:
    """Kernel name -> PTX parameter types of the module loaded for ``source`` (read on the driver launcher's
    first use of the source, so that the cupy launcher never depends on it)."""
    _module(source, device_index)
    return driver_launch.ptx_params(_PTX[(source, device_index)])


@lru_cache(maxsize=None)
def kernel(source: str, name: str, device_index: int) -> Any:
    """The compiled kernel ``name`` of ``kernels/<source>`` for one device (cached)."""
    return _module(source, device_index).get_function(name)


@lru_cache(maxsize=None)
def multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (``cuda`` without an index means the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _no_cuda_stream(index: int) -> int:
    raise RuntimeError(f"torch {torch.__version__} is not built with CUDA: there is no stream on device {index}")


# current_raw_stream(index): the handle (``cudaStream_t`` as an int) of torch's current stream on
# device ``index``.
#
# [Note: the raw stream] ``torch.cuda.current_stream(index).cuda_stream`` builds a
# ``torch.cuda.Stream`` object per call; the private ``torch._C._cuda_getCurrentRawStream``
# (what bitsandbytes uses) returns the handle alone. zcomm_cuda is the bottom layer and may
# import nothing of zcomm, so this one name is where it touches that private API: it *is*
# torch's function (a launch enters no Python frame for it), or, in a torch without CUDA, one
# that raises. ``tests/quant/test_cuda_launch_host.py`` pins that it agrees with the public
# form on a GPU.
current_raw_stream: Callable[[int], int] = getattr(torch._C, "_cuda_getCurrentRawStream", _no_cuda_stream)


# (raw stream handle, device index) -> the cupy ExternalStream wrapping it; see [Note: stream objects]
_STREAMS: dict[tuple[int, int], Any] = {}


def _external_stream(handle: int, index: int) -> Any:
    """A cupy stream object for the raw ``handle``, made once per (handle, device).

    [Note: stream objects] A ``cupy.cuda.ExternalStream`` only wraps a handle: it neither
    owns nor synchronizes the stream. Keeping one per handle is safe even after torch destroys
    that stream: a launch uses the wrapper of the handle it was given this call, and a new
    stream that reuses the handle is the same stream to the driver.
    """
    stream = _STREAMS.get((handle, index))
    if stream is None:
        import cupy

        stream = _STREAMS[(handle, index)] = cupy.cuda.ExternalStream(handle, index)
    return stream


# [Note: launcher choice] Two launchers enqueue a kernel: ``cupy`` (the cupy ``Function`` call)
# and ``driver`` (``cuLaunchKernelEx`` through ctypes with a parameter block made once per
# kernel and thread, :mod:`zcomm_cuda.driver_launch`). $ZCOMM_CUDA_LAUNCHER picks one; it is
# read once, on the process's first launch (or first :func:`launcher` call), and a value
# other than LAUNCHERS raises there. Neither falls back to the other: a failing driver
# launch raises. :func:`set_launcher` switches for the rest of the process (the A/B rows of
# bench.host_cost). Both enqueue the same kernel, grid and arguments on the same stream.
LAUNCHER_ENV = "ZCOMM_CUDA_LAUNCHER"
LAUNCHERS = ("cupy", "driver")
DEFAULT_LAUNCHER = "cupy"
_use_driver: bool | None = None  # None until the choice is read


def launcher() -> str:
    """The launcher this process uses ([Note: launcher choice]); reads $ZCOMM_CUDA_LAUNCHER on first use."""
    use_driver = _use_driver if _use_driver is not None else _read_launcher()
    return "driver" if use_driver else "cupy"


def set_launcher(name: str) -> None:
    """Launch with ``name`` (one of LAUNCHERS) from now on, whatever $ZCOMM_CUDA_LAUNCHER says."""
    global _use_driver
    _use_driver = _launcher_named(name, "set_launcher")


def _read_launcher() -> bool:
    global _use_driver
    _use_driver = _launcher_named(os.environ.get(LAUNCHER_ENV, DEFAULT_LAUNCHER), f"${LAUNCHER_ENV}")
    return _use_driver


def _launcher_named(name: str, source: str) -> bool:
    if name not in LAUNCHERS:
        raise ValueError(f"{source} is {name!r}: the CUDA kernel launcher is one of {', '.join(LAUNCHERS)}")
    return name == "driver"


def launch(source: str, name: str, device: torch.device, blocks: int, threads: int, args: Sequence[Any]) -> None:
    """Launch kernel ``name`` on ``device`` on torch's current stream for that device.

    [Note: stream ordering] The kernel is enqueued on torch's current stream of the device
    ([Note: the raw stream]), so it runs after everything the caller already queued on that
    stream (the producer of the input) and before everything queued after it (the
    collective that sends the payload): the caller's ordering holds with no synchronization,
    exactly as for a torch op. Tensors are passed as raw ``data_ptr()`` addresses; the
    caller keeps them alive, and torch's caching allocator does not reuse their memory for
    other streams' allocations before work queued on this stream has run. The launch makes no
    Python object per call beyond the argument tuple: the kernel, the stream wrapper (cupy) or
    the parameter block (driver) and the device switch (only when the runtime's current device
    differs) are looked up, not built. The launcher is the process's ([Note: launcher choice]).
    """
    index = device.index
    if index is None:
        index = torch.cuda.current_device()
    use_driver = _use_driver if _use_driver is not None else _read_launcher()
    handle = current_raw_stream(index)
    if use_driver:
        target = _DRIVER_KERNELS.get((source, name, index))
        if target is None:
            target = _driver_kernel(source, name, index)
        if _current_device() == index:
            target.launch(blocks, threads, handle, args)
            return
        import cupy

        with cupy.cuda.Device(index):
            target.launch(blocks, threads, handle, args)
        return
    function = kernel(source, name, index)
    stream = _STREAMS.get((handle, index))
    if stream is None:
        stream = _external_stream(handle, index)
    args = args if type(args) is tuple else tuple(args)
    if _current_device() == index:
        function((blocks,), (threads,), args, 0, stream)  # (grid, block, args, shared_mem, stream)
        return
    import cupy

    with cupy.cuda.Device(index):
        function((blocks,), (threads,), args, 0, stream)


# (source, kernel name, device index) -> the kernel as the driver launcher launches it
_DRIVER_KERNELS: dict[tuple[str, str, int], driver_launch.DriverKernel] = {}


def _driver_kernel(source: str, name: str, index: int) -> driver_launch.DriverKernel:
    """Kernel ``name`` of ``source`` on device ``index`` for the driver launcher, made once.

    The module is compiled and loaded as for cupy (:func:`kernel`); the driver launches its
    ``CUfunction`` with the parameter types of the PTX that was loaded.
    """
    function = kernel(source, name, index)
    params = _ptx_params(source, index).get(name)
    if params is None:
        raise RuntimeError(f"{name} is not an entry of the PTX compiled from {source}")
    target = driver_launch.DriverKernel(name=name, function=function.ptr, params=params, device=index,
                                        driver=driver_launch.driver(), owner=function)  # fmt: skip
    _DRIVER_KERNELS[(source, name, index)] = target
    return target


def _current_device() -> int:
    """The CUDA runtime's current device of this thread (torch and cupy share it).

    The first call rebinds this module's name to cupy's ``getDevice`` itself, so later launches
    call it with no Python frame in between.
    """
    global _current_device
    get_device = _cupy_runtime().getDevice
    _current_device = get_device
    return get_device()


@lru_cache(maxsize=None)
def _cupy_runtime() -> Any:
    """``cupy.cuda.runtime``, imported once (on the first launch: this module imports without cupy)."""
    from cupy.cuda import runtime

    return runtime
