"""nvcc's and NVRTC's outputs, each built once per session, started in the background before the tests that read them.

[Note: background builds] The slowest work of the CUDA tests is the compilers': about ten seconds
for each nvcc PTX compile of dequant_reduce.cu, more for NVRTC's PTX and cubin of it, twenty for
the host check's binary. Several tests read the same build (tests/quant/test_cuda_compile.py checks the forbidden instructions, the kernels
defined and the hardware narrowing of one PTX; test_cuda_launch_abi.py the kernels' parameter
types of the same PTX), so each (translation unit, arch, options) is built once and its output
(or its error) shared. And the builds do not wait for their tests: when collection ends
(tests/quant/conftest.py) each selected test module that names its builds (a module-level
``builds_of(item, builds)``) has them started, in the order of the tests, on all cores but
one, while pytest runs the tests before them on the last core; a test that waits for a build
lends that core to one more build meanwhile. A test asks for its build's result; a build that
failed raises its error in every test that reads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Hashable, Iterator, NamedTuple

from zcomm_cuda.loader import KERNEL_DIR, CompiledSource, compile_source, expand_includes


class Ptx(NamedTuple):
    """One ``nvcc --ptx`` of ``source`` of kernels/: as it sits there (``unit=False``, its includes
    found beside it) or as the loader's translation unit (``unit=True``, includes inlined by
    ``expand_includes``: what NVRTC compiles)."""

    source: str
    unit: bool
    arch: str
    options: tuple[str, ...]


class Nvrtc(NamedTuple):
    """One compile of the loader itself, ``zcomm_cuda.loader.compile_source`` (NVRTC releases the GIL)."""

    source: str
    arch: str
    options: tuple[str, ...]


class Builds:
    """Builds by key, each run at most once, on a pool of ``workers`` threads; ``folder`` holds their
    files. Without ``nvcc`` (None) or NVRTC (``nvrtc=False``) their builds are not started early."""

    def __init__(self, nvcc: str | None, nvrtc: bool, folder: Path, workers: int | None = None) -> None:
        self.nvcc = nvcc
        self.has_nvrtc = nvrtc
        self.folder = folder
        self._workers = max(1, (os.cpu_count() or 2) - 1) if workers is None else workers
        self._pool = ThreadPoolExecutor(max_workers=self._workers + 1, thread_name_prefix="nvcc")
        self._started: dict[Hashable, Future] = {}
        self._slots = threading.Condition()
        self._running = 0
        self._lent = 0  # tests waiting for a build: each lends its core to one more build

    def start(self, key: Hashable, build: Callable[[], object]) -> None:
        """Start ``build()`` under ``key`` unless a build of that key was started."""
        if key not in self._started:
            self._started[key] = self._pool.submit(self._in_a_slot, build)

    def result(self, key: Hashable, build: Callable[[], object]) -> object:
        """What ``build()`` returned (started now unless it was), or the exception it raised.
        While the caller waits, one more build may run (on the caller's core)."""
        self.start(key, build)
        with self._lending():
            return self._started[key].result()

    @contextlib.contextmanager
    def _lending(self) -> Iterator[None]:
        """While the caller waits, one more build may run."""
        with self._slots:
            self._lent += 1
            self._slots.notify_all()
        try:
            yield
        finally:
            with self._slots:
                self._lent -= 1

    def _in_a_slot(self, build: Callable[[], object]) -> object:
        with self._slots:
            self._slots.wait_for(lambda: self._running < self._workers + self._lent)
            self._running += 1
        try:
            return build()
        finally:
            with self._slots:
                self._running -= 1
                self._slots.notify_all()

    def start_ptx(self, job: Ptx) -> None:
        if self.nvcc is not None:
            self.start(job, lambda: self._ptx(job))

    def ptx(self, job: Ptx) -> str:
        """The PTX of ``job``; an AssertionError with nvcc's messages if it did not compile."""
        return self.result(job, lambda: self._ptx(job))

    def start_nvrtc(self, job: Nvrtc) -> None:
        if self.has_nvrtc:
            self.start(job, lambda: compile_source(*job))

    def nvrtc(self, job: Nvrtc) -> CompiledSource:
        """What ``compile_source`` returned for ``job``, or the exception it raised."""
        return self.result(job, lambda: compile_source(*job))

    def wait(self) -> None:
        """Wait until every build started has ended (for a test that changes what builds read)."""
        with self._lending():
            for future in list(self._started.values()):
                future.exception()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _ptx(self, job: Ptx) -> str:
        assert self.nvcc is not None, "nvcc not found"
        name = f"{hashlib.sha1(repr(job).encode()).hexdigest()[:12]}-{job.source}"
        if job.unit:
            source = self.folder / name
            source.write_text(expand_includes(KERNEL_DIR / job.source))
            assert '#include "' not in source.read_text()
        else:
            source = KERNEL_DIR / job.source
        out = self.folder / f"{name}.{job.arch}.ptx"
        done = subprocess.run(
            [self.nvcc, "--ptx", f"-arch={job.arch}", *job.options, "-o", str(out), str(source)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"nvcc {job}: {done.stderr}"
        return out.read_text()
