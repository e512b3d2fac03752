"""One host_check process that runs every case of a build ([Note: host check server] in host_check.cu).

Starting a process per case cost more than most cases' work (2,241 cases). The server reads one
command a line and answers each with its output and exit status; each test still sends its own
command and asserts on its own answer. A command that kills the process (an ``abort`` in the
kernels' cursor checks) fails its test with the process's status and standard error, and the next
command starts a new process.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cuda_support import NVCC, REPO
from nvcc_builds import Builds

KERNELS = REPO / "zcomm_cuda" / "kernels"
SOURCE = Path(__file__).resolve().parent / "cuda_host" / "host_check.cu"
END = "\x1e "  # the line that closes a command's output: END + exit status


class HostCheckError(AssertionError):
    """A host_check command that exited with a non-zero status or ended the process."""


class HostCheck:
    """``host_check serve`` of ``binary``; ``scratch`` is a folder for the cases' input and output files."""

    def __init__(self, binary: Path, scratch: Path) -> None:
        self.binary = binary
        self.scratch = scratch
        self._stderr = scratch / "host_check.stderr"
        self._process: subprocess.Popen[str] | None = None

    def _start(self) -> subprocess.Popen[str]:
        if self._process is None:
            with self._stderr.open("w") as stderr:
                self._process = subprocess.Popen(
                    [str(self.binary), "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True
                )
        return self._process

    def run(self, *args: object) -> str:
        """The standard output of ``host_check ARGS...``; raises :class:`HostCheckError` unless it exits 0."""
        words = [str(arg) for arg in args]
        assert not any("\t" in word or "\n" in word for word in words), words
        process = self._start()
        assert process.stdin is not None and process.stdout is not None
        errors_from = self._stderr.stat().st_size
        lines = []
        try:
            process.stdin.write("\t".join(words) + "\n")
            process.stdin.flush()
            for line in process.stdout:
                if line.startswith(END):
                    status = int(line[len(END):])
                    break
                lines.append(line)
            else:
                raise BrokenPipeError
        except BrokenPipeError:
            self.close()
            raise HostCheckError(f"host_check {' '.join(words)} ended the process (status {process.returncode}): "
                                 f"{self._errors(errors_from)}{''.join(lines)}") from None
        if status != 0:
            raise HostCheckError(f"host_check {' '.join(words)} exited with status {status}: "
                                 f"{self._errors(errors_from)}{''.join(lines)}")
        return "".join(lines)

    def _errors(self, start: int) -> str:
        with self._stderr.open() as stderr:
            stderr.seek(start)
            return stderr.read()

    def close(self) -> None:
        process, self._process = self._process, None
        if process is not None:
            assert process.stdin is not None and process.stdout is not None
            try:
                process.stdin.close()
            except BrokenPipeError:  # the process is gone
                pass
            process.wait()
            process.stdout.close()


def build(builds: Builds) -> Path:
    """nvcc's host build of the host check, in ``builds``' folder."""
    binary = builds.folder / "host_check"
    done = subprocess.run(
        [NVCC, "-std=c++17", "-O1", "-Xcompiler", "-ffp-contract=off", f"-I{KERNELS}", "-o", str(binary), str(SOURCE)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return binary


def builds_of(item: pytest.Item, builds: Builds) -> None:
    """A test module's ``builds_of`` (the conftest calls it per test when collection ends): the
    host check's binary is built in the background ([Note: background builds] in nvcc_builds.py)."""
    if "host_check" in getattr(item, "fixturenames", ()):
        builds.start(SOURCE, lambda: build(builds))
