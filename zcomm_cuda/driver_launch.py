"""Kernel launches through the CUDA driver API, called with ``ctypes``: the ``driver`` launcher.

cupy's launch of a compiled function converts every argument into a new C value object per
call and builds the parameter array anew (about 5 us of host time per launch on an H200).
Here each kernel's parameters are laid out once, per thread, in a :class:`ParamBlock`: one
C buffer holding the launch configuration (``CUlaunchConfig``) and a slot per kernel
parameter, and a ``void*`` array pointing at the slots. A launch writes the grid, the block,
the stream and the argument values into the buffer with one ``struct.pack_into`` (a single
C call) and calls ``cuLaunchKernelEx(&config, function, params, NULL)``; nothing else is
built per call.

[Note: launch entry point] ``cuLaunchKernelEx`` (CUDA 12.0 on) takes the configuration as a
struct instead of nine scalar arguments, so the ``ctypes`` call converts 4 arguments, all of
them plain ints of the block, instead of 11 (``bench.host_cost --launch-stand-in`` on a 2-core Xeon: a
no-op C function called through ``ctypes`` costs 0.33 us with 4 arguments, 1.2 us with 11).
The configuration fields it reads are those of ``cuLaunchKernel``'s scalars, with no
launch attributes (``numAttrs`` 0): the two launch the same way.

[Note: parameter layout] The slots' C types come from the kernel itself: the ``.param``
list of its ``.entry`` in the PTX the loader compiled (:func:`ptx_params`), whose widths and
kinds (integer or float) are the C signature's. Each slot is 8 bytes (a 4-byte parameter
fills the low half: little-endian). The first launch of a kernel on a thread checks the
arguments against that list as cupy's launch would read them: numpy scalars, each of its
parameter's width and kind, or, for a 64-bit integer parameter only, a Python ``int`` in
[0, 2^63) (a tensor's address: cupy passes an int as a 64-bit integer, exact in that range,
and raises above it); any other Python ``int`` or ``float`` has no width of its own and is
refused. It derives the ``struct`` codes from them (``Q``/``q``, ``I``/``i``, ``f``, ``d``; an
int's slot is ``Q``, so a negative value raises later).
Every later launch packs its values with those codes, so a value is stored at its
parameter's width or the launch raises (a float where an integer goes, an integer out of
range, a wrong count; an integer where a float goes is converted as C would): a mismatch
cannot be misread by the kernel. Every launch packs all values, the sizes that repeat from
one launch to the next included: one C call whatever the count, where each further value
costs about 25 ns (``bench.host_cost --launch-stand-in``: 0.41 us for 6 values, 0.56 us for 12), less than
telling the constant values from the addresses per call would: ``struct`` writes its pad bytes
as zeros, so writing the addresses alone takes a ``pack_into`` per run of them besides the
configuration's (0.53 us for a quantize launch's two runs, against 0.40 us for one pack of all
six values, on a 2-core Xeon).

[Note: parameter blocks per thread] The collectives launch from worker threads while the
main thread launches too. ``cuLaunchKernelEx`` copies the configuration and the parameter
values before it returns, so a block can be rewritten right after; it must not be rewritten
by another thread between the packing and the call. Each thread therefore has its own
block per kernel (``threading.local``): no lock on the launch path, and a block dies with
its thread.

[Note: driver context] The driver launches into the calling thread's current context; the
CUDA runtime (torch, cupy) makes a device's primary context current on a thread lazily, so
a worker thread that has only looked up torch's stream may have none. The first launch of a
kernel on a thread therefore checks ``cuCtxGetCurrent`` and, when no context is current,
makes the device's primary context current (the context torch and cupy use, where the
loader loaded the module), as cupy's launch does per thread; a current context of another
device raises. The caller launches only while the runtime's current device is the kernel's
(:func:`zcomm_cuda.loader.launch`).
"""

from __future__ import annotations

import ctypes
import functools
import re
import struct
import sys
import threading
from typing import Any, Sequence

import numpy as np

# CUlaunchConfig (cuda.h): gridDim x/y/z, blockDim x/y/z, sharedMemBytes, (pad), hStream,
# attrs, numAttrs, (pad); 56 bytes. tests/quant/test_cuda_driver_launch.py checks the
# offsets against a C compiler's layout of the toolkit's cuda.h.
CONFIG_FORMAT = "IIIIIII4xQQI4x"
CONFIG_BYTES = struct.calcsize("<" + CONFIG_FORMAT)
SLOT_BYTES = 8
LIBRARY = "libcuda.so.1"

# PTX parameter type -> (bytes, is float)
_PTX_TYPES = {
    "u64": (8, False), "b64": (8, False), "s64": (8, False),
    "u32": (4, False), "b32": (4, False), "s32": (4, False),
    "f32": (4, True), "f64": (8, True),
}  # fmt: skip
_CODES = {(8, False, False): "Q", (8, False, True): "q", (4, False, False): "I", (4, False, True): "i",
          (4, True, True): "f", (8, True, True): "d"}  # fmt: skip
_INT_SLOT_END = 2**63  # a Python int in a 64-bit slot: what cupy passes exactly (as numpy.int64)
_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)")
_ARRAY = re.compile(r"\[\d+\]$")

assert CONFIG_BYTES == 56
assert sys.byteorder == "little", "a 4-byte parameter is stored in the low half of its 8-byte slot"


def ptx_params(ptx: str) -> dict[str, tuple[str, ...]]:
    """Kernel name -> its parameters' PTX types (``("u64", "u64", "f32", ...)``), for every entry of ``ptx``.

    A parameter passed as a byte array (a struct by value: ``.b8 name[16]``) is listed as
    ``"b8[16]"``, which no launch can pack (:func:`slot_codes` refuses it).
    """
    return {name: tuple(_param_type(item) for item in body.split(",") if item.strip())
            for name, body in _ENTRY.findall(ptx)}  # fmt: skip


def _param_type(declaration: str) -> str:
    """``u64`` of ``.param .u64 k_param_0`` (also ``.param .u64 .ptr .align 1 k_param_0``); ``b8[16]`` of
    ``.param .align 8 .b8 k_param_1[16]``."""
    tokens = declaration.split()
    assert tokens[0] == ".param", declaration
    kinds = [token[1:] for token in tokens[1:] if token.startswith(".") and token not in (".align", ".ptr")]
    array = _ARRAY.search(tokens[-1])
    return kinds[0] + (array.group() if array else "")


def slot_codes(name: str, params: Sequence[str], args: Sequence[Any]) -> str:
    """The ``struct`` codes of ``args`` for kernel ``name``'s ``params``, one 8-byte slot each.

    Raises ``TypeError`` naming the argument when the count differs or an argument is neither a
    numpy scalar of its parameter's width and kind nor, for a 64-bit integer parameter, a Python
    ``int`` in [0, 2^63) ([Note: parameter layout]).
    """
    if len(args) != len(params):
        raise TypeError(f"{name} takes {len(params)} arguments (.{', .'.join(params)}), the launch passed {len(args)}")
    codes = []
    for position, (param, arg) in enumerate(zip(params, args, strict=True)):
        kind = _PTX_TYPES.get(param)
        if kind is None:
            raise TypeError(f"{name}: parameter {position} is .{param}, which the driver launcher cannot pack")
        width, is_float = kind
        if type(arg) is int and width == SLOT_BYTES and not is_float:
            if not 0 <= arg < _INT_SLOT_END:
                raise TypeError(f"{name}: argument {position} is int {arg!r}, its parameter is .{param}: a Python int "
                                f"goes there only as an address, in [0, 2**63)")  # fmt: skip
            codes.append("Q")
            continue
        numeric = np.floating if is_float else np.integer
        if not isinstance(arg, numeric) or arg.itemsize != width:
            raise TypeError(
                f"{name}: argument {position} is {type(arg).__name__} {arg!r}, its parameter is .{param}: pass a "
                f"numpy {'float' if is_float else 'integer'} scalar of {width} bytes"
            )
        code = _CODES[(width, is_float, is_float or isinstance(arg, np.signedinteger))]
        codes.append(code if width == SLOT_BYTES else f"{code}{SLOT_BYTES - width}x")
    return "".join(codes)


class ParamBlock:
    """One thread's launch memory for one kernel: the configuration and the parameter slots.

    ``buffer`` holds ``CUlaunchConfig`` (its address is ``config``) followed by one 8-byte
    slot per parameter; ``pointers`` is the ``void*`` array of the slots' addresses (its
    address is ``params``). Both are made once; :meth:`write` fills them for one launch.
    """

    __slots__ = ("buffer", "pointers", "config", "params", "codes", "pack")

    def __init__(self, codes: str, count: int) -> None:
        layout = struct.Struct("<" + CONFIG_FORMAT + codes)
        assert layout.size == CONFIG_BYTES + SLOT_BYTES * count, (codes, count)
        self.buffer = (ctypes.c_uint64 * (layout.size // 8))()
        self.config = ctypes.addressof(self.buffer)
        slots = [self.config + CONFIG_BYTES + SLOT_BYTES * i for i in range(count)]
        self.pointers = (ctypes.c_void_p * max(count, 1))(*slots)
        self.params = ctypes.addressof(self.pointers)
        self.codes = codes
        # pack(grid x, y, z, block x, y, z, shared bytes, stream, attrs, numAttrs, *args)
        self.pack = functools.partial(layout.pack_into, self.buffer, 0)

    def write(self, blocks: int, threads: int, stream: int, args: Sequence[Any]) -> None:
        """Fill the configuration (``blocks`` x 1 x 1 blocks of ``threads`` x 1 x 1, no shared
        memory, ``stream``, no attributes) and the slots with ``args``."""
        self.pack(blocks, 1, 1, threads, 1, 1, 0, stream, 0, 0, *args)


class Driver:
    """The driver functions the launcher calls, bound once from ``lib`` (``libcuda.so.1``, or a stand-in)."""

    def __init__(self, lib: Any) -> None:
        void_p = ctypes.c_void_p
        self.launch_kernel_ex = _bind(lib, "cuLaunchKernelEx", void_p, void_p, void_p, void_p)
        self._error_string = _bind(lib, "cuGetErrorString", ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        self._error_name = _bind(lib, "cuGetErrorName", ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        self._ctx_get_current = _bind(lib, "cuCtxGetCurrent", ctypes.POINTER(void_p))
        self._ctx_set_current = _bind(lib, "cuCtxSetCurrent", void_p)
        self._ctx_get_device = _bind(lib, "cuCtxGetDevice", ctypes.POINTER(ctypes.c_int))
        self._device_get = _bind(lib, "cuDeviceGet", ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        self._primary_retain = _bind(lib, "cuDevicePrimaryCtxRetain", ctypes.POINTER(void_p), ctypes.c_int)

    def describe(self, result: int) -> str:
        """``CUDA_ERROR_... (code): text`` for a ``CUresult``."""
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        named = self._error_name(result, ctypes.byref(name)) == 0 and name.value
        told = self._error_string(result, ctypes.byref(text)) == 0 and text.value
        return (f"{name.value.decode() if named else 'CUresult'} ({result}): "
                f"{text.value.decode() if told else 'the driver has no text for this code'}")  # fmt: skip

    def check(self, result: int, what: str) -> None:
        if result:
            raise RuntimeError(f"{what} failed: {self.describe(result)}")

    def ensure_context(self, device: int) -> None:
        """Make ``device``'s primary context current on this thread if none is ([Note: driver context])."""
        context = ctypes.c_void_p()
        self.check(self._ctx_get_current(ctypes.byref(context)), "cuCtxGetCurrent")
        if not context.value:
            handle = ctypes.c_int()
            self.check(self._device_get(ctypes.byref(handle), device), f"cuDeviceGet({device})")
            # Retained for the life of the process: it is the context torch and cupy hold anyway.
            self.check(self._primary_retain(ctypes.byref(context), handle), f"cuDevicePrimaryCtxRetain({device})")
            self.check(self._ctx_set_current(context), f"cuCtxSetCurrent(device {device})")
        current = ctypes.c_int()
        self.check(self._ctx_get_device(ctypes.byref(current)), "cuCtxGetDevice")
        expected = ctypes.c_int()
        self.check(self._device_get(ctypes.byref(expected), device), f"cuDeviceGet({device})")
        if current.value != expected.value:
            raise RuntimeError(f"the current CUDA context of this thread is device {current.value}'s, the launch is "
                               f"on device {device}")  # fmt: skip


def _bind(lib: Any, name: str, *argtypes: Any) -> Any:
    function = getattr(lib, name)
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int
    return function


@functools.lru_cache(maxsize=None)
def driver() -> Driver:
    """The process's :class:`Driver` over ``libcuda.so.1`` (loaded on first use)."""
    try:
        lib = ctypes.CDLL(LIBRARY)
    except OSError as exc:
        raise RuntimeError(f"the driver launcher needs the CUDA driver library {LIBRARY}: {exc}") from exc
    try:
        return Driver(lib)
    except AttributeError as exc:
        raise RuntimeError(f"{LIBRARY} lacks a function the driver launcher calls (cuLaunchKernelEx needs a "
                           f"CUDA 12.0 driver or newer): {exc}") from exc  # fmt: skip


class DriverKernel:
    """One loaded kernel as the driver launches it: its ``CUfunction``, parameters and device.

    ``function`` is the ``CUfunction`` handle (cupy's ``Function.ptr``); ``owner`` is kept
    alive with it (the cupy ``Function``, which keeps its module loaded); ``params`` its PTX
    parameter types ([Note: parameter layout]).
    """

    __slots__ = ("name", "function", "params", "device", "driver", "owner", "_threads", "_launch_ex")

    def __init__(self, *, name: str, function: int, params: Sequence[str], device: int, driver: Driver,
                 owner: Any = None) -> None:  # fmt: skip
        self.name, self.function, self.params, self.device = name, function, tuple(params), device
        self.driver, self.owner = driver, owner
        self._threads = threading.local()
        self._launch_ex = driver.launch_kernel_ex

    def launch(self, blocks: int, threads: int, stream: int, args: Sequence[Any]) -> None:
        """Enqueue ``blocks`` blocks of ``threads`` threads on ``stream`` with ``args`` (this thread's block)."""
        try:
            block = self._threads.block
        except AttributeError:
            block = self._new_block(args)
        try:
            block.pack(blocks, 1, 1, threads, 1, 1, 0, stream, 0, 0, *args)  # ParamBlock.write, without its frame
        except struct.error as exc:
            raise self._mismatch(block, blocks, threads, stream, args, exc) from exc
        result = self._launch_ex(block.config, self.function, block.params, None)
        if result:
            raise RuntimeError(f"cuLaunchKernelEx of {self.name} on device {self.device} failed: "
                               f"{self.driver.describe(result)}")  # fmt: skip

    def block(self) -> ParamBlock | None:
        """This thread's block, None before its first launch here."""
        return getattr(self._threads, "block", None)

    def _new_block(self, args: Sequence[Any]) -> ParamBlock:
        codes = slot_codes(self.name, self.params, args)
        self.driver.ensure_context(self.device)
        block = self._threads.block = ParamBlock(codes, len(self.params))
        return block

    def _mismatch(self, block: ParamBlock, blocks: int, threads: int, stream: int, args: Sequence[Any],
                  exc: struct.error) -> Exception:  # fmt: skip
        """The error of a launch whose values do not fit the block: TypeError for a wrong argument, else ValueError."""
        try:
            slot_codes(self.name, self.params, args)
        except TypeError as wrong:
            return wrong
        return ValueError(f"{self.name}: grid {blocks}, block {threads}, stream {stream!r} or an argument of "
                          f"{tuple(args)!r} does not fit its slot ({block.codes}): {exc}")  # fmt: skip
