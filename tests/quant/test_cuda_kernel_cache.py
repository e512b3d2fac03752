"""The disk cache of compiled kernels, the build command, prepare() and the device-checks switch.

The cache ([Note: kernel cache] in zcomm_cuda/_disk_cache.py) promises: an entry per (source
text with its headers, options, arch, NVRTC version); a hit compiles nothing; a truncated or
corrupt entry is recompiled, never loaded; processes that fill one folder at once all succeed
and leave one whole entry. Most tests drive the cache with a stand-in compile; those that run
NVRTC compile dequantize.cu, the cheapest source, once per module where they can share it.
The device checks ([Note: device checks] in zcomm_cuda/loader.py) promise that no kernel traps
outside the debug compile: a small translation unit shows the switch, and
tests/quant/test_cuda_compile.py checks every source's PTX without it.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from cuda_support import REPO, requires_gpu, requires_nvrtc
from zcomm_cuda import _disk_cache, build, loader

CHEAP = "dequantize.cu"
ENTRY = _disk_cache.Entry("// ptx\n.entry k(\n", b"\x7fELF" + bytes(range(256)) * 64)
KEY_FIELDS = dict(source="s.cu", text="int x;\n", options=("-std=c++17",), arch="sm_90", nvrtc_version=(13, 0))


def _key(**changes) -> bytes:
    return _disk_cache.entry_key(**{**KEY_FIELDS, **changes})


# --- where the cache lives ------------------------------------------------------------------


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv(_disk_cache.CACHE_DIR_ENV, raising=False)
    assert _disk_cache.cache_dir() == tmp_path / "home" / ".cache" / "zcomm"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert _disk_cache.cache_dir() == tmp_path / "xdg" / "zcomm"
    monkeypatch.setenv(_disk_cache.CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert _disk_cache.cache_dir() == tmp_path / "mine"


# --- keys and entries -----------------------------------------------------------------------


@pytest.mark.parametrize("change", [
    dict(source="t.cu"), dict(text="int y;\n"), dict(options=("-std=c++17", "-DZCOMM_DEVICE_CHECKS=1")),
    dict(options=()), dict(arch="sm_80"), dict(arch="compute_90"), dict(nvrtc_version=(13, 1)),
], ids=["source", "text", "option-added", "option-removed", "arch", "ptx-arch", "nvrtc-version"])  # fmt: skip
def test_every_input_changes_the_key(change):
    assert _key(**change) != _key()
    assert _key() == _key()  # and nothing else does


def test_key_depends_on_option_order():
    assert _key(options=("-a", "-b")) != _key(options=("-b", "-a"))  # NVRTC takes the last of a repeated option


def test_entry_round_trip():
    key = _key()
    assert _disk_cache.decode(_disk_cache.encode(key, ENTRY), key) == ENTRY
    ptx_only = _disk_cache.Entry(ENTRY.ptx, None)
    assert _disk_cache.decode(_disk_cache.encode(key, ptx_only), key) == ptx_only


def _damaged() -> dict[str, bytes]:
    key = _key()
    data = _disk_cache.encode(key, ENTRY)
    flipped = bytearray(data)
    flipped[-100] ^= 1
    return {"empty": b"", "header only": data[:40], "truncated": data[:-1], "extended": data + b"\0",
            "flipped": bytes(flipped), "other key": _disk_cache.encode(_key(arch="sm_80"), ENTRY),
            "not an entry": b"x" * len(data)}  # fmt: skip


@pytest.mark.parametrize("name", list(_damaged()))
def test_damaged_entries_are_refused(name):
    with pytest.raises(ValueError):
        _disk_cache.decode(_damaged()[name], _key())


class FakeCompile:
    """Stands in for NVRTC: counts its calls and returns ENTRY."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> _disk_cache.Entry:
        self.calls += 1
        return ENTRY


def _fetch(directory: Path, compile: FakeCompile, **changes) -> _disk_cache.Fetched:
    fields = {**KEY_FIELDS, **changes}
    return _disk_cache.load_or_compile(directory, fields["source"], fields["text"], fields["options"], fields["arch"],
                                       fields["nvrtc_version"], compile)  # fmt: skip


def test_miss_then_hit(tmp_path):
    compile = FakeCompile()
    first = _fetch(tmp_path, compile)
    assert first.compiled and compile.calls == 1 and first.entry == ENTRY
    second = _fetch(tmp_path, compile)
    assert not second.compiled and compile.calls == 1 and second.entry == ENTRY and second.path == first.path
    assert _fetch(tmp_path, compile, options=("-DX=1",)).compiled and compile.calls == 2  # another key
    assert sorted(p.suffix for p in (tmp_path / "kernels").iterdir()) == [".lock", ".lock", ".zck", ".zck"]


@pytest.mark.parametrize("name", ["empty", "truncated", "flipped", "other key"])
def test_a_damaged_entry_is_compiled_again(tmp_path, name):
    compile = FakeCompile()
    path = _fetch(tmp_path, compile).path
    path.write_bytes(_damaged()[name])
    with pytest.warns(UserWarning, match="is unusable"):
        again = _fetch(tmp_path, compile)
    assert again.compiled and compile.calls == 2 and again.entry == ENTRY
    assert _disk_cache.decode(path.read_bytes(), _key()) == ENTRY  # replaced by a whole entry


def test_an_unwritable_cache_still_serves_and_warns(tmp_path, monkeypatch):
    compile = FakeCompile()
    _fetch(tmp_path, compile)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_disk_cache.tempfile, "mkstemp", refuse)  # as in a read-only image folder
    assert not _fetch(tmp_path, compile).compiled  # its entries still serve
    with pytest.warns(UserWarning, match="could not store"):
        fetched = _fetch(tmp_path, compile, arch="sm_80")
    assert fetched.compiled and fetched.entry == ENTRY and not fetched.path.exists()


# --- processes that start together ----------------------------------------------------------


def _fill_racing(directory: str, start: float, results, real: bool) -> None:
    """One of the racing processes: wait for the common start, then fetch the same entry."""
    marks = Path(directory) / "compiles"

    def compile() -> _disk_cache.Entry:
        with open(marks, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.3)  # a compile takes time: the others arrive while it runs
        return ENTRY

    time.sleep(max(0.0, start - time.time()))
    if real:
        fetched = loader.load_or_compile(CHEAP, "sm_90", directory=Path(directory))
    else:
        fetched = _fetch(Path(directory), compile)
    results.put((fetched.compiled, fetched.entry.ptx, fetched.entry.cubin))


def _race(directory: Path, real: bool, processes: int = 4) -> list[tuple]:
    context = multiprocessing.get_context("fork")  # nothing here has touched a GPU
    results = context.Queue()
    start = time.time() + 1.0
    workers = [context.Process(target=_fill_racing, args=(str(directory), start, results, real))
               for _ in range(processes)]  # fmt: skip
    for worker in workers:
        worker.start()
    try:
        got = [results.get(timeout=120) for _ in workers]
        for worker in workers:
            worker.join(timeout=60)
            assert worker.exitcode == 0
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
    return got


def _one_whole_entry(directory: Path) -> Path:
    entries = sorted((directory / "kernels").iterdir())
    assert not [p for p in entries if p.name.endswith(".tmp")], entries  # no temporary file left
    (entry,) = [p for p in entries if p.suffix == _disk_cache.ENTRY_SUFFIX]
    return entry


def test_four_processes_filling_one_folder(tmp_path):
    got = _race(tmp_path, real=False)
    assert all(result[1:] == ENTRY for result in got)
    # the lock lets one of them compile; the others read its entry
    assert sum(compiled for compiled, *_ in got) == 1
    assert len((tmp_path / "compiles").read_text().split()) == 1
    assert _disk_cache.decode(_one_whole_entry(tmp_path).read_bytes(), _key()) == ENTRY


def test_without_locks_racing_writers_still_leave_one_whole_entry(tmp_path, monkeypatch):
    """Where the filesystem refuses flock each process compiles, and the renames keep every reader whole."""
    import fcntl

    def refuse(fd, operation):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    got = _race(tmp_path, real=False)
    assert all(result[1:] == ENTRY for result in got)
    assert sum(compiled for compiled, *_ in got) >= 2  # they compiled side by side
    assert _disk_cache.decode(_one_whole_entry(tmp_path).read_bytes(), _key()) == ENTRY


@requires_nvrtc
def test_four_processes_compiling_with_nvrtc(tmp_path):
    got = _race(tmp_path, real=True)
    assert sum(compiled for compiled, *_ in got) == 1
    assert len({(ptx, cubin) for _, ptx, cubin in got}) == 1
    ptx, cubin = got[0][1:]
    assert "zc_dequantize_f32_int8" in ptx and cubin
    assert _one_whole_entry(tmp_path).name.startswith("dequantize-sm_90-")


# --- the loader and the build command on NVRTC ---------------------------------------------


def _build(directory: Path) -> subprocess.CompletedProcess:
    """``python -m zcomm_cuda.build`` of dequantize.cu for sm_90 into ``directory``, device checks off."""
    env = {**os.environ, loader.DEVICE_CHECKS_ENV: "0"}
    return subprocess.run([sys.executable, "-m", "zcomm_cuda.build", "--arch", "sm_90", "--sources", CHEAP,
                           "--cache-dir", str(directory)], capture_output=True, text=True, cwd=REPO, env=env)  # fmt: skip


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, str]:
    """A cache folder filled with dequantize.cu for sm_90 by the build command, and what it printed."""
    directory = tmp_path_factory.mktemp("cache")
    done = _build(directory)
    assert done.returncode == 0, done.stderr
    return directory, done.stdout


@requires_nvrtc
def test_build_command_compiles_then_finds(built):
    directory, first = built
    assert re.search(r"compiled\s+dequantize\.cu\s+sm_90", first) and "1 modules (1 compiled, 0 found)" in first
    start = time.perf_counter()
    done = _build(directory)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    assert re.search(r"found\s+dequantize\.cu\s+sm_90", done.stdout) and "(0 compiled, 1 found)" in done.stdout
    print(f"\nsecond process (python start included): {seconds:.2f} s; it reports:\n{done.stdout}")


@requires_nvrtc
def test_loader_reads_what_the_build_command_wrote(built, monkeypatch):
    directory, _ = built
    monkeypatch.setenv(_disk_cache.CACHE_DIR_ENV, str(directory))
    monkeypatch.setattr(loader, "_device_checks", False)
    before = loader.compile_count()
    fetched = loader.load_or_compile(CHEAP, "sm_90")
    assert not fetched.compiled and loader.compile_count() == before
    assert fetched.path.parent == directory / "kernels" and fetched.entry.cubin
    assert set(re.findall(r"\.entry\s+(\w+)\(", fetched.entry.ptx)) == {
        f"zc_dequantize_{t}_int{b}" for t in ("f32", "bf16", "f16") for b in (8, 4)}


@requires_nvrtc
def test_loader_keys_on_nvrtc_version_options_and_arch(built, monkeypatch):
    """A new NVRTC, the device checks' define or another arch is a miss; compile_source is then called."""
    from cupy.cuda import nvrtc

    directory, _ = built
    calls = []
    monkeypatch.setattr(loader, "compile_source", lambda *args: calls.append(args) or loader.CompiledSource("p", b"c"))
    monkeypatch.setattr(loader, "_device_checks", False)
    assert not loader.load_or_compile(CHEAP, "sm_90", directory=directory).compiled
    assert loader.load_or_compile(CHEAP, "sm_80", directory=directory).compiled
    monkeypatch.setattr(loader, "_device_checks", True)
    assert loader.load_or_compile(CHEAP, "sm_90", directory=directory).compiled
    monkeypatch.setattr(loader, "_device_checks", False)
    version = nvrtc.getVersion()
    monkeypatch.setattr(nvrtc, "getVersion", lambda: (version[0], version[1] + 1))
    assert loader.load_or_compile(CHEAP, "sm_90", directory=directory).compiled
    assert [(source, arch, options[-1]) for source, arch, options in calls] == [
        (CHEAP, "sm_80", "--prec-sqrt=true"), (CHEAP, "sm_90", loader.DEVICE_CHECKS_DEFINE),
        (CHEAP, "sm_90", "--prec-sqrt=true")]


def test_build_command_refuses_unknown_archs(capsys):
    pytest.importorskip("cupy")
    with pytest.raises(SystemExit):
        build.main(["--arch", "sm_91", "--cache-dir", "/nonexistent"])
    assert "--arch sm_91" in capsys.readouterr().err


# --- compiles are observable; prepare() resolves up front ----------------------------------


def test_compile_hooks_see_every_compile(monkeypatch, tmp_path):
    (tmp_path / "k.cu").write_text("}")  # not C++: NVRTC is never reached, the hook raises first

    def forbid(source, arch, options):
        raise AssertionError(f"compiled {source} for {arch}")

    monkeypatch.setattr(loader, "KERNEL_DIR", tmp_path)
    monkeypatch.setattr(loader, "COMPILE_HOOKS", [forbid])
    pytest.importorskip("cupy")
    before = loader.compile_count()
    with pytest.raises(AssertionError, match="compiled k.cu for sm_90"):
        loader.compile_source("k.cu", "sm_90")
    assert loader.compile_count() == before


class FakeModule:
    def __init__(self, source: str, names: set[str]) -> None:
        self.source, self.names = source, names

    def get_function(self, name: str) -> tuple[str, str]:
        if name not in self.names:
            raise KeyError(f"no kernel {name} in {self.source}")
        return (self.source, name)


@pytest.fixture
def fake_modules(monkeypatch):
    """loader._module replaced by modules of known kernels (made once per source and device, as the
    real one is), recording each load; the kernel cache cleared around it."""
    loads, made = [], {}

    def module(source: str, index: int) -> FakeModule:
        if (source, index) not in made:
            loads.append((source, index))
            made[(source, index)] = FakeModule(source, {"a", "b"})
        return made[(source, index)]

    loader.kernel.cache_clear()
    monkeypatch.setattr(loader, "_module", module)
    yield loads
    loader.kernel.cache_clear()


def test_prepare_loads_each_source_once_and_resolves_every_kernel(fake_modules):
    loader.prepare([("x.cu", "a"), ("y.cu", "a"), ("x.cu", "b")], 3)
    assert sorted(fake_modules) == [("x.cu", 3), ("y.cu", 3)]
    assert loader.kernel.cache_info().currsize == 3
    hits = loader.kernel.cache_info().hits
    assert loader.kernel("x.cu", "b", 3) == ("x.cu", "b")
    assert loader.kernel.cache_info().hits == hits + 1  # resolved by prepare: a lookup, no load


def test_prepare_raises_for_an_unknown_kernel(fake_modules):
    with pytest.raises(KeyError, match="no kernel c in y.cu"):
        loader.prepare([("x.cu", "a"), ("y.cu", "c")], 0)


@requires_gpu
def test_prepare_then_launch_compiles_nothing(monkeypatch):
    """After prepare(), a launch of a prepared kernel neither compiles nor loads a module."""
    import numpy as np
    import torch

    from zcomm.quant import wire_format

    index = torch.cuda.current_device()
    name = "zc_dequantize_f32_int8"
    loader.prepare([(CHEAP, name)], index)
    monkeypatch.setattr(loader, "COMPILE_HOOKS", [lambda *args: pytest.fail(f"compiled {args[:2]}")])
    loads = loader._module.cache_info().misses
    rows, numel, group_size = 2, 48, 16
    row_nbytes = wire_format.payload_nbytes(numel, 8, group_size)
    payloads = torch.zeros(rows, row_nbytes, dtype=torch.uint8, device="cuda")  # codes 0, scales 0: zeros
    out = torch.full((rows * numel,), float("nan"), device="cuda")
    sizes = tuple(np.int64(v) for v in (row_nbytes, numel, group_size, rows))
    loader.launch(CHEAP, name, out.device, 1, 256, (payloads.data_ptr(), *sizes, out.data_ptr()))
    assert torch.equal(out.cpu(), torch.zeros(rows * numel))  # it ran
    assert loader._module.cache_info().misses == loads


# --- device checks --------------------------------------------------------------------------


@pytest.mark.parametrize("value,on", [("", False), ("0", False), ("1", True)])
def test_device_checks_switch(monkeypatch, value, on):
    monkeypatch.setattr(loader, "_device_checks", None)
    monkeypatch.setenv(loader.DEVICE_CHECKS_ENV, value)
    assert loader.device_checks() is on
    monkeypatch.setenv(loader.DEVICE_CHECKS_ENV, "0" if on else "1")
    assert loader.device_checks() is on  # read once
    assert (loader.DEVICE_CHECKS_DEFINE in loader.nvrtc_options()) is on
    assert loader.nvrtc_options()[: len(loader.NVRTC_OPTIONS)] == loader.NVRTC_OPTIONS


@pytest.mark.parametrize("value", ["yes", "true", "2", " 1"])
def test_device_checks_switch_refuses_other_values(monkeypatch, value):
    monkeypatch.setattr(loader, "_device_checks", None)
    monkeypatch.setenv(loader.DEVICE_CHECKS_ENV, value)
    with pytest.raises(ValueError, match="ZCOMM_CUDA_DEVICE_CHECKS"):
        loader.device_checks()


def test_traps_only_inside_the_switch():
    """Every __trap of the kernels is ZC_DEVICE_CHECK's, in its debug branch; no kernel calls __trap or
    the PTX trap itself."""
    found = []
    for path in sorted(loader.KERNEL_DIR.iterdir()):
        for line in path.read_text().splitlines():
            if re.search(r"__trap|\btrap\s*;|__brkpt|\bassert\s*\(", line):
                found.append((path.name, line.strip()))
    assert found == [("wire_math.cuh", "if (!(cond)) __trap(); \\")]
    text = (loader.KERNEL_DIR / "wire_math.cuh").read_text()
    debug = text[text.index("#if defined(ZCOMM_DEVICE_CHECKS) && ZCOMM_DEVICE_CHECKS"):text.index("#else", text.index(
        "#if defined(ZCOMM_DEVICE_CHECKS)"))]  # fmt: skip
    assert "__trap()" in debug


@requires_nvrtc
def test_device_check_traps_only_with_the_define(monkeypatch, tmp_path):
    """ZC_DEVICE_CHECK compiles to a trap instruction with -DZCOMM_DEVICE_CHECKS=1 and to nothing
    without it (every kernel source's PTX is checked without it in test_cuda_compile.py)."""
    (tmp_path / "check.cu").write_text(
        f'#include "{loader.KERNEL_DIR / "wire_math.cuh"}"\n'
        'extern "C" __global__ void k(const int* x, int* y) { ZC_DEVICE_CHECK(x[0] == 1); y[0] = x[1]; }\n')
    monkeypatch.setattr(loader, "KERNEL_DIR", tmp_path)
    plain = loader.compile_source("check.cu", "compute_90")
    checked = loader.compile_source("check.cu", "compute_90", (*loader.NVRTC_OPTIONS, loader.DEVICE_CHECKS_DEFINE))
    traps = [len(re.findall(r"\btrap\s*;", c.ptx)) for c in (plain, checked)]
    assert traps == [0, 1]


def test_warnings_module_is_quiet_on_a_hit(tmp_path):
    """A hit warns of nothing (a warning is reserved for an unusable entry or an unwritable folder)."""
    compile = FakeCompile()
    _fetch(tmp_path, compile)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _fetch(tmp_path, compile).compiled
