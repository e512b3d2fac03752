"""The ``driver`` launcher (:mod:`zcomm_cuda.driver_launch`): parameter blocks, the switch, the call.

On any machine (no GPU, no libcuda): the configuration's layout is cuda.h's; the parameter
block of every launch the cuda backend makes holds each value at its parameter's width, read
back from memory (the parameter types are those of the launch's arguments, which
test_cuda_launch_abi.py holds to the kernels' PTX; ``ptx_params`` of NVRTC's PTX, as the
loader compiles it, is checked to agree); rewriting the addresses changes exactly the
address slots; a wrong-typed argument raises; ``$ZCOMM_CUDA_LAUNCHER`` is
validated; the launcher calls ``cuLaunchKernelEx`` (a ctypes callback standing in for the
driver) with the configuration and parameters it was given, raises with the driver's error
text on a failed launch, makes a context current on a thread that has none and gives each
thread its own block. On a GPU: both launchers write the same bytes for every kernel, from
the main thread, a fresh worker thread and a CUDA graph replay, and a launch the driver
refuses raises.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import types

import numpy as np
import pytest
import torch

from cuda_fakes import fake_launch_plans
from cuda_support import NVCC, requires_gpu, requires_nvcc, requires_nvrtc
from nvcc_builds import Builds, Nvrtc
from test_cuda_launch_abi import DTYPES, _run_every_op
from zcomm.quant.backends import _cuda_launch as cuda_launch
from zcomm_cuda import driver_launch, loader

WIDTH = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4, "f64": 8}


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` as cuda.h declares it; ctypes lays it out as the C compiler does."""

    _fields_ = [(name, ctypes.c_uint) for name in ("gridDimX", "gridDimY", "gridDimZ", "blockDimX", "blockDimY",
                                                   "blockDimZ", "sharedMemBytes")]  # fmt: skip
    _fields_ += [("hStream", ctypes.c_void_p), ("attrs", ctypes.c_void_p), ("numAttrs", ctypes.c_uint)]


def slot_values(block: driver_launch.ParamBlock, params: tuple[str, ...]) -> list[bytes]:
    """The bytes each of the block's parameter pointers points at, as wide as its parameter."""
    pointers = (ctypes.c_void_p * len(params)).from_address(block.params)
    return [ctypes.string_at(pointers[i], WIDTH[param]) for i, param in enumerate(params)]


# -- parameter blocks ---------------------------------------------------------------------------------------------


def test_config_layout_is_cuda_hs() -> None:
    """The struct format's configuration fields sit where C puts CUlaunchConfig's (``LaunchConfig``, checked
    against the toolkit's cuda.h below)."""
    assert ctypes.sizeof(LaunchConfig) == driver_launch.CONFIG_BYTES
    block = driver_launch.ParamBlock("", 0)
    block.write(7, 96, 0xABCDEF12345, ())
    config = LaunchConfig.from_address(block.config)
    got = [getattr(config, name) for name, _ in LaunchConfig._fields_]
    assert got == [7, 1, 1, 96, 1, 1, 0, 0xABCDEF12345, None, 0]


CONFIG_PROBE = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
#define AT(field) printf("%s %zu\n", #field, offsetof(CUlaunchConfig, field));
int main(void) {
    AT(gridDimX) AT(gridDimY) AT(gridDimZ) AT(blockDimX) AT(blockDimY) AT(blockDimZ) AT(sharedMemBytes)
    AT(hStream) AT(attrs) AT(numAttrs)
    printf("size %zu\n", sizeof(CUlaunchConfig));
    return 0;
}
"""


@requires_nvcc
def test_config_layout_is_the_compilers_reading_of_cuda_h(tmp_path) -> None:
    """CUlaunchConfig's field offsets and size as the host compiler lays out the toolkit's cuda.h (nvcc adds its
    include path)."""
    (tmp_path / "probe.c").write_text(CONFIG_PROBE)
    subprocess.run([NVCC, "-o", str(tmp_path / "probe"), str(tmp_path / "probe.c")], check=True)
    printed = dict(line.split() for line in subprocess.run([str(tmp_path / "probe")], check=True, capture_output=True,
                                                           text=True).stdout.splitlines())  # fmt: skip
    offsets = {name: str(getattr(LaunchConfig, name).offset) for name, _ in LaunchConfig._fields_}
    assert printed == {**offsets, "size": str(driver_launch.CONFIG_BYTES)}


def test_ptx_params_reads_every_declaration_form() -> None:
    ptx = """
.visible .entry k_one(
	.param .u64 k_one_param_0,
	.param .u64 .ptr .global .align 1 k_one_param_1,
	.param .f32 k_one_param_2,
	.param .u32 k_one_param_3
)
{ ret; }
.visible .entry k_two(
	.param .align 8 .b8 k_two_param_0[16]
)
{ ret; }
.visible .entry k_none()
{ ret; }
"""
    assert driver_launch.ptx_params(ptx) == {"k_one": ("u64", "u64", "f32", "u32"), "k_two": ("b8[16]",),
                                             "k_none": ()}  # fmt: skip
    with pytest.raises(TypeError, match=r"parameter 0 is \.b8\[16\]"):
        driver_launch.slot_codes("k_two", ("b8[16]",), (np.uint64(0),))


def as_ptx(arg: object) -> str:
    """The PTX type of the parameter a launch argument is for: test_cuda_launch_abi.py checks every launch's
    argument types against its kernel's PTX, so they stand for the kernel's signature here."""
    return {int: "u64", np.uint64: "u64", np.int64: "u64", np.int32: "u32", np.float32: "f32"}[type(arg)]


@pytest.fixture()
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int, tuple]]:
    """Every launch the cuda backend makes over its ops (both bit widths, both encoder schemes, every dtype)."""
    launches = []
    monkeypatch.setattr(loader, "launch", lambda source, name, device, blocks, threads, args:
                        launches.append((name, blocks, threads, tuple(args))))  # fmt: skip
    fake_launch_plans(monkeypatch)
    for bits in (8, 4):
        for group_size in (64, 10_000):
            for dtype in DTYPES:
                _run_every_op(bits, dtype, group_size)
    return launches


def test_every_launch_is_packed_at_its_parameters_widths(recorded) -> None:
    """Each slot holds its argument's bytes at the PTX width; rewriting the addresses changes those slots only."""
    kernels = set()
    for name, blocks, threads, args in recorded:
        params = tuple(as_ptx(arg) for arg in args)
        block = driver_launch.ParamBlock(driver_launch.slot_codes(name, params, args), len(params))
        block.write(blocks, threads, 0x5000, args)
        assert slot_values(block, params) == [np.asarray(arg).tobytes() for arg in args], name
        config = LaunchConfig.from_address(block.config)
        assert (config.gridDimX, config.blockDimX, config.hStream) == (blocks, threads, 0x5000)
        pointers = (ctypes.c_void_p * len(params)).from_address(block.params)
        assert list(pointers) == [block.config + driver_launch.CONFIG_BYTES + 8 * i for i in range(len(params))]

        addresses = [i for i, arg in enumerate(args) if type(arg) is int]  # the tensors' addresses, Python ints
        assert addresses, name
        before = bytes(block.buffer)
        moved = tuple(arg + 0x10000 + i if i in addresses else arg for i, arg in enumerate(args))
        block.write(blocks, threads, 0x5000, moved)
        after = bytes(block.buffer)
        changed = {(at - driver_launch.CONFIG_BYTES) // 8 for at in range(len(after)) if before[at] != after[at]}
        assert changed == set(addresses), name
        assert slot_values(block, params) == [np.asarray(arg).tobytes() for arg in moved], name
        kernels.add(name)
    families = ("zc_quantize_", "zc_dequantize_", "zc_reorder_quantize_", "zc_reorder_interleaved_",
                "zc_dequant_reduce_f", "zc_dequant_reduce_b", "zc_dequant_reduce_requant_")  # fmt: skip
    assert all(any(name.startswith(family) for name in kernels) for family in families), sorted(kernels)


# NVRTC's PTX read below: the loader's compile of the two fastest sources
NVRTC_COMPILES = [Nvrtc(source, "compute_90", loader.NVRTC_OPTIONS) for source in ("quantize.cu", "dequantize.cu")]


def builds_of(item: pytest.Item, builds: Builds) -> None:
    """Start the compiles ``item`` reads ([Note: background builds] in nvcc_builds.py)."""
    if getattr(item, "originalname", None) == "test_ptx_params_of_the_loaders_compile_are_the_launches":
        for job in NVRTC_COMPILES:
            builds.start_nvrtc(job)


@requires_nvrtc
def test_ptx_params_of_the_loaders_compile_are_the_launches(recorded, nvcc_builds) -> None:
    """``ptx_params`` of NVRTC's PTX (the loader's compile; the two fastest sources) gives every launched
    kernel of them its parameters as the launches pass them."""
    params = {}
    for job in NVRTC_COMPILES:
        params.update(driver_launch.ptx_params(nvcc_builds.nvrtc(job).ptx))
    launched = {name: tuple(as_ptx(arg) for arg in args) for name, _, _, args in recorded if name in params}
    assert launched == params and len(params) >= 12  # 3 dtypes x 2 widths x 2 ops at least


DEQUANT_REDUCE = ("u64", "u64", "u64", "u64", "u64", "f32", "u64")
GOOD = (0x7000, np.int64(40), np.int64(1024), np.int64(256), np.int64(4), np.float32(4.0), 0x9000)


def test_an_address_packs_as_a_python_int_or_a_numpy_uint64() -> None:
    """A 64-bit integer slot takes an address as the Python int ``data_ptr()`` returns (the cuda backend's
    launches) or as a numpy scalar, and stores the same 8 bytes; the highest address cupy can pass too."""
    for address in (0x7000, 2**63 - 1):
        args = (address, *GOOD[1:])
        codes = driver_launch.slot_codes("k", DEQUANT_REDUCE, args)
        block = driver_launch.ParamBlock(codes, len(DEQUANT_REDUCE))
        block.write(1, 256, 0, args)
        assert slot_values(block, DEQUANT_REDUCE)[0] == np.uint64(address).tobytes()
        block.write(1, 256, 0, (np.uint64(address), *GOOD[1:]))
        assert slot_values(block, DEQUANT_REDUCE)[0] == np.uint64(address).tobytes()


@pytest.mark.parametrize("position, value, why", [
    (5, 4, "Python int for a float"),
    (1, np.int32(40), "int32 for an int64"),
    (5, np.float64(4.0), "double for a float"),
    (5, np.int64(4), "integer for a float"),
    (2, np.float32(1024.0), "float for an integer"),
])  # fmt: skip
def test_a_wrong_typed_argument_raises(position, value, why) -> None:
    args = GOOD[:position] + (value,) + GOOD[position + 1 :]
    with pytest.raises(TypeError, match=f"argument {position} is {type(value).__name__}"):
        driver_launch.slot_codes("zc_dequant_reduce_f32_int8", DEQUANT_REDUCE, args)


@pytest.mark.parametrize("value", [-1, 2**63, True])
def test_a_python_int_that_is_no_address_raises(value) -> None:
    """Only [0, 2^63) is an address both launchers pass exactly (cupy raises above it); a bool is no address."""
    args = (value, *GOOD[1:])
    with pytest.raises(TypeError, match=f"argument 0 is {type(value).__name__}"):
        driver_launch.slot_codes("zc_dequant_reduce_f32_int8", DEQUANT_REDUCE, args)


def test_a_wrong_count_raises() -> None:
    for args in (GOOD[:-1], (*GOOD, np.uint64(0))):
        with pytest.raises(TypeError, match=f"takes 7 arguments .* passed {len(args)}"):
            driver_launch.slot_codes("k", DEQUANT_REDUCE, args)


# -- a stand-in driver --------------------------------------------------------------------------------------------


class FakeDriverLibrary:
    """``libcuda``'s functions the launcher binds, as ctypes callbacks that record what they were given.

    ``cuLaunchKernelEx`` reads the configuration and the parameter values at the call, as the
    driver does (``params`` says their types); ``result`` is what it returns.
    """

    ERRORS = {700: (b"CUDA_ERROR_ILLEGAL_ADDRESS", b"an illegal memory access was encountered")}

    def __init__(self, params: tuple[str, ...], *, current_context: int = 0xC0, context_device: int = 0) -> None:
        self.params, self.result, self.launches, self.calls = params, 0, [], []
        self.current_context, self.context_device = current_context, context_device
        self._strings = {}
        void_p, out_p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
        self.cuLaunchKernelEx = ctypes.CFUNCTYPE(ctypes.c_int, void_p, void_p, void_p, void_p)(self._launch)
        error_out = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, void_p)
        self.cuGetErrorName = error_out(lambda code, out: self._error(code, out, 0))
        self.cuGetErrorString = error_out(lambda code, out: self._error(code, out, 1))
        self.cuCtxGetCurrent = ctypes.CFUNCTYPE(ctypes.c_int, out_p)(self._get_current)
        self.cuCtxSetCurrent = ctypes.CFUNCTYPE(ctypes.c_int, void_p)(self._set_current)
        self.cuCtxGetDevice = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))(self._get_device)
        self.cuDeviceGet = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_int)(self._device)
        self.cuDevicePrimaryCtxRetain = ctypes.CFUNCTYPE(ctypes.c_int, out_p, ctypes.c_int)(self._retain)

    def _launch(self, config: int, function: int, params: int, extra: int | None) -> int:
        c = LaunchConfig.from_address(config)
        pointers = (ctypes.c_void_p * len(self.params)).from_address(params)
        values = [ctypes.string_at(pointers[i], WIDTH[p]) for i, p in enumerate(self.params)]
        self.launches.append({
            "grid": (c.gridDimX, c.gridDimY, c.gridDimZ), "block": (c.blockDimX, c.blockDimY, c.blockDimZ),
            "shared": c.sharedMemBytes, "stream": c.hStream or 0, "attrs": (c.attrs, c.numAttrs),
            "function": function, "values": values, "extra": extra, "thread": threading.get_ident(),
        })  # fmt: skip
        return self.result

    def _error(self, code: int, out: int, which: int) -> int:
        if code not in self.ERRORS:
            return 1
        text = self._strings.setdefault((code, which), ctypes.create_string_buffer(self.ERRORS[code][which]))
        ctypes.c_void_p.from_address(out).value = ctypes.addressof(text)  # a static string, as the driver's
        return 0

    def _get_current(self, out) -> int:
        self.calls.append("cuCtxGetCurrent")
        out[0] = self.current_context or None
        return 0

    def _set_current(self, context: int) -> int:
        self.calls.append(("cuCtxSetCurrent", context))
        self.current_context = context
        return 0

    def _get_device(self, out) -> int:
        out[0] = self.context_device
        return 0

    def _device(self, out, ordinal: int) -> int:
        out[0] = ordinal
        return 0

    def _retain(self, out, device: int) -> int:
        self.calls.append(("cuDevicePrimaryCtxRetain", device))
        out[0] = 0xD0 + device
        return 0


def values_of(args) -> list[bytes]:
    return [np.asarray(arg).tobytes() for arg in args]


def make_kernel(lib: FakeDriverLibrary, device: int = 0) -> driver_launch.DriverKernel:
    return driver_launch.DriverKernel(name="zc_dequant_reduce_f32_int8", function=0xF00, params=lib.params,
                                      device=device, driver=driver_launch.Driver(lib))  # fmt: skip


def test_launch_calls_cuLaunchKernelEx_with_the_grid_block_stream_and_values() -> None:
    lib = FakeDriverLibrary(DEQUANT_REDUCE)
    target = make_kernel(lib)
    target.launch(1056, 256, 0x5A5A, GOOD)
    moved = (0x7100, *GOOD[1:-1], 0x9100)
    target.launch(3, 128, 0, moved)
    first, second = lib.launches
    assert first == {"grid": (1056, 1, 1), "block": (256, 1, 1), "shared": 0, "stream": 0x5A5A, "attrs": (None, 0),
                     "function": 0xF00, "values": values_of(GOOD), "extra": None, "thread": threading.get_ident()}
    assert (second["grid"], second["block"], second["stream"]) == ((3, 1, 1), (128, 1, 1), 0)
    assert second["values"] == values_of(moved)


def test_a_failed_launch_raises_with_the_drivers_error_text() -> None:
    lib = FakeDriverLibrary(DEQUANT_REDUCE)
    lib.result = 700
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx of zc_dequant_reduce_f32_int8 on device 0 failed: "
                                           r"CUDA_ERROR_ILLEGAL_ADDRESS \(700\): an illegal memory access"):
        make_kernel(lib).launch(1, 256, 0, GOOD)
    lib.result = 999  # a code the driver has no name for
    with pytest.raises(RuntimeError, match=r"CUresult \(999\)"):
        make_kernel(lib).launch(1, 256, 0, GOOD)


def test_wrong_values_raise_before_any_launch() -> None:
    lib = FakeDriverLibrary(DEQUANT_REDUCE)
    target = make_kernel(lib)
    with pytest.raises(TypeError, match="argument 5 is int"):
        target.launch(1, 256, 0, (*GOOD[:5], 4, GOOD[6]))  # the first launch on this thread checks the types
    target.launch(1, 256, 0, GOOD)
    with pytest.raises(TypeError, match="argument 1 is float32"):
        target.launch(1, 256, 0, (GOOD[0], np.float32(40.0), *GOOD[2:]))  # later ones cannot pack a float there
    with pytest.raises(TypeError, match="argument 0 is int -1"):
        target.launch(1, 256, 0, (-1, *GOOD[1:]))  # nor a negative address
    with pytest.raises(ValueError, match="does not fit"):
        target.launch(2**32, 256, 0, GOOD)
    with pytest.raises(TypeError, match="takes 7 arguments"):
        target.launch(1, 256, 0, GOOD[:-1])
    assert len(lib.launches) == 1


def test_each_thread_packs_its_own_block() -> None:
    """Threads launching at once each see their own values at the call ([Note: parameter blocks per thread])."""
    lib = FakeDriverLibrary(DEQUANT_REDUCE)
    target = make_kernel(lib)
    expected, blocks = {}, {}
    start = threading.Barrier(4)

    def run(tag: int) -> None:
        args = (tag << 20, *GOOD[1:-1], (tag << 20) + 1)
        expected[threading.get_ident()] = values_of(args)
        start.wait()
        for _ in range(300):
            target.launch(tag, 256, tag, args)
        blocks[tag] = target.block()

    workers = [threading.Thread(target=run, args=(tag,)) for tag in (1, 2, 3, 4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(lib.launches) == 1200
    for launch in lib.launches:
        assert launch["values"] == expected[launch["thread"]] and launch["grid"][0] == launch["stream"]
    assert len({id(block) for block in blocks.values()}) == 4 and target.block() is None


def test_a_thread_without_a_context_gets_the_devices_primary_one() -> None:
    lib = FakeDriverLibrary(DEQUANT_REDUCE, current_context=0, context_device=1)
    make_kernel(lib, device=1).launch(1, 256, 0, GOOD)
    assert ("cuDevicePrimaryCtxRetain", 1) in lib.calls and ("cuCtxSetCurrent", 0xD1) in lib.calls
    held = FakeDriverLibrary(DEQUANT_REDUCE, current_context=0xC0, context_device=0)
    make_kernel(held).launch(1, 256, 0, GOOD)
    assert held.calls == ["cuCtxGetCurrent"]  # a current context is left as it is
    other = FakeDriverLibrary(DEQUANT_REDUCE, current_context=0xC0, context_device=1)
    with pytest.raises(RuntimeError, match="device 1's, the launch is on device 0"):
        make_kernel(other).launch(1, 256, 0, GOOD)
    assert not other.launches


# -- the switch and the loader ------------------------------------------------------------------------------------


@pytest.fixture()
def unread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader as before its first launch: $ZCOMM_CUDA_LAUNCHER not read yet."""
    monkeypatch.setattr(loader, "_use_driver", None)
    monkeypatch.delenv(loader.LAUNCHER_ENV, raising=False)


def test_launcher_is_read_once_from_the_environment(unread, monkeypatch: pytest.MonkeyPatch) -> None:
    assert loader.launcher() == "cupy"  # the default
    monkeypatch.setattr(loader, "_use_driver", None)
    monkeypatch.setenv(loader.LAUNCHER_ENV, "driver")
    assert loader.launcher() == "driver"
    monkeypatch.setenv(loader.LAUNCHER_ENV, "cupy")
    assert loader.launcher() == "driver"  # read once
    loader.set_launcher("cupy")
    assert loader.launcher() == "cupy"


@pytest.mark.parametrize("value", ["Driver", "", "ctypes"])
def test_an_invalid_launcher_raises_naming_the_choices(unread, monkeypatch: pytest.MonkeyPatch, value) -> None:
    monkeypatch.setenv(loader.LAUNCHER_ENV, value)
    with pytest.raises(ValueError, match=f"ZCOMM_CUDA_LAUNCHER is {value!r}: .* one of cupy, driver"):
        loader.launch("quantize.cu", "k", torch.device("cuda", 0), 1, 256, ())
    with pytest.raises(ValueError, match="one of cupy, driver"):
        loader.set_launcher(value)


def test_loader_launches_through_the_driver_kernel(unread, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``driver`` chosen, a launch goes to the kernel's DriverKernel on torch's raw stream, switching the
    device only when the current one differs; cupy's function is not called."""
    monkeypatch.setenv(loader.LAUNCHER_ENV, "driver")
    lib = FakeDriverLibrary(DEQUANT_REDUCE)
    monkeypatch.setattr(loader, "_DRIVER_KERNELS", {("dequant_reduce.cu", "k", 0): make_kernel(lib)})
    monkeypatch.setattr(loader, "kernel", lambda *key: pytest.fail(f"the cupy function of {key} was looked up"))
    monkeypatch.setattr(loader, "current_raw_stream", lambda index: 0x77)
    current = [0]
    monkeypatch.setattr(loader, "_current_device", lambda: current[0])
    switches = []

    class Device:
        def __init__(self, index: int) -> None:
            self.index = index

        def __enter__(self) -> None:
            switches.append(self.index)

        def __exit__(self, *exc) -> None:
            switches.append(-1)

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(Device=Device)))
    loader.launch("dequant_reduce.cu", "k", torch.device("cuda", 0), 12, 256, GOOD)
    current[0] = 1
    loader.launch("dequant_reduce.cu", "k", torch.device("cuda", 0), 12, 256, list(GOOD))
    assert switches == [0, -1]
    assert [(launch["grid"], launch["stream"], launch["values"]) for launch in lib.launches] == [
        ((12, 1, 1), 0x77, values_of(GOOD))] * 2  # fmt: skip


def test_the_driver_kernel_is_made_once_from_the_loaded_function_and_its_ptx(unread, monkeypatch) -> None:
    """The loader's glue: the CUfunction of the function cupy loaded, the parameters of the PTX that was
    loaded, the process's driver; made on the first launch, looked up after; an unknown name raises."""
    ptx = ".visible .entry k(\n" + ",\n".join(f"\t.param .{t} k_param_{i}" for i, t in enumerate(DEQUANT_REDUCE)) + "\n)"
    lib = FakeDriverLibrary(DEQUANT_REDUCE)
    looked_up = []
    monkeypatch.setenv(loader.LAUNCHER_ENV, "driver")
    monkeypatch.setattr(loader, "_DRIVER_KERNELS", {})
    monkeypatch.setattr(loader, "_module", lambda source, index: None)
    monkeypatch.setitem(loader._PTX, ("dequant_reduce.cu", 0), ptx)
    monkeypatch.setattr(loader, "kernel", lambda *key: looked_up.append(key) or types.SimpleNamespace(ptr=0xF00))
    monkeypatch.setattr(driver_launch, "driver", lambda: driver_launch.Driver(lib))
    monkeypatch.setattr(loader, "current_raw_stream", lambda index: 0x77)
    monkeypatch.setattr(loader, "_current_device", lambda: 0)
    loader._ptx_params.cache_clear()
    try:
        for _ in range(2):
            loader.launch("dequant_reduce.cu", "k", torch.device("cuda", 0), 12, 256, GOOD)
        with pytest.raises(RuntimeError, match="nope is not an entry of the PTX compiled from dequant_reduce.cu"):
            loader.launch("dequant_reduce.cu", "nope", torch.device("cuda", 0), 12, 256, GOOD)
    finally:
        loader._ptx_params.cache_clear()
    assert looked_up == [("dequant_reduce.cu", "k", 0), ("dequant_reduce.cu", "nope", 0)]
    assert [(launch["function"], launch["values"]) for launch in lib.launches] == [(0xF00, values_of(GOOD))] * 2
    made = loader._DRIVER_KERNELS[("dequant_reduce.cu", "k", 0)]
    assert made.params == DEQUANT_REDUCE and made.owner.ptr == 0xF00


# -- on a GPU -----------------------------------------------------------------------------------------------------


def _every_op(x: torch.Tensor, interleaved: bool = True) -> list[torch.Tensor]:
    """Every kernel of ``x``'s dtype: each op at both widths, both encoder schemes, both reorder forms (the
    interleaved one, which uploads a table per call, only with ``interleaved``: a graph cannot capture it), and
    the re-quantizing reduction into both widths."""
    import zcomm.quant as zq

    g, numel, outs = 256, x.numel(), []
    pieces = [x[: 6 * g], x[6 * g : 18 * g]]  # 6 parts of 4 * g: each tensor's piece, then a zero fill
    for bits in (8, 4):
        payload = zq.quantize(x, bits, g)
        rows = torch.stack([payload, zq.quantize(x.flip(0), bits, g)])
        outs += [
            payload, zq.quantize(x, bits, 8192),
            zq.dequantize(rows, numel, bits, g, x.dtype),
            zq.reorder_quantize(x, (3, 1, 0, 2), 4, bits, g),
            *([zq.reorder_quantize(pieces, (2, 0, 1, 5, 4, 3), 3, bits, g, parts=6, part_numel=4 * g)]
              if interleaved else []),
            zq.dequant_reduce(rows, numel, bits, g, dtype=x.dtype, divide_by=2.0),
            *(zq.dequant_reduce(rows, numel, bits, g, requant_chunks=4, requant_bits=out) for out in (8, 4)),
        ]  # fmt: skip
    return outs


@pytest.fixture()
def restore_launcher():
    before = loader.launcher()
    yield
    loader.set_launcher(before)


@requires_gpu
def test_both_launchers_write_the_same_bytes(restore_launcher) -> None:
    """Every kernel under cupy, then under the driver (each dtype); bf16 also from a fresh worker thread (no
    context current yet) and replayed from a CUDA graph captured with the driver launcher."""
    for dtype in (torch.float32, torch.float16):  # bf16 below
        x = torch.randn(1 << 16, device="cuda").to(dtype)
        loader.set_launcher("cupy")
        expected = _every_op(x)
        loader.set_launcher("driver")
        assert [torch.equal(a, b) for a, b in zip(_every_op(x), expected, strict=True)] == [True] * len(expected), dtype
    x = torch.randn(1 << 16, device="cuda").to(torch.bfloat16)
    loader.set_launcher("cupy")
    expected = _every_op(x)
    loader.set_launcher("driver")
    assert [torch.equal(a, b) for a, b in zip(_every_op(x), expected, strict=True)] == [True] * len(expected)
    from_worker = []
    worker = threading.Thread(target=lambda: from_worker.extend(_every_op(x)))
    worker.start()
    worker.join()
    torch.cuda.synchronize()
    assert [torch.equal(a, b) for a, b in zip(from_worker, expected, strict=True)] == [True] * len(expected)
    static = x.clone()
    _every_op(static, interleaved=False)  # warm: plans, permutation upload
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _every_op(static, interleaved=False)
    static.copy_(x.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    loader.set_launcher("cupy")
    again = _every_op(x.flip(0), interleaved=False)
    assert [torch.equal(a, b) for a, b in zip(captured, again, strict=True)] == [True] * len(again)


@requires_gpu
def test_a_launch_the_driver_refuses_raises(restore_launcher) -> None:
    loader.set_launcher("driver")
    out = torch.empty(1 << 10, dtype=torch.uint8, device="cuda")
    x = torch.zeros(1 << 10, device="cuda")
    args = (x.data_ptr(), np.int64(x.numel()), np.int64(256), out.data_ptr(), 0, np.int32(cuda_launch.TEAMS))
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx of zc_quantize_f32_int8 on device \d+ failed: "
                                           r"CUDA_ERROR_[A-Z_]+ \(\d+\): \w"):
        loader.launch("quantize.cu", "zc_quantize_f32_int8", x.device, 1, 4096, args)  # 4096 threads: too many
