"""One rank's NVMe swap file: aligned regions read and written asynchronously on a small thread pool.

[Note: swap file lifetime] The file is created under ``nvme_path`` when the offloaded
optimizer starts, with its full size reserved (``posix_fallocate``), so a full or unwritable
directory is a clear ``ValueError`` at start-up and never a failure half-way through an
optimizer step. It is removed by ``close()``, when its owner is garbage collected, and at
interpreter exit (``weakref.finalize`` registers an ``atexit`` hook), which includes exits
through an uncaught exception; only a killed process (SIGKILL, OOM killer) leaves it behind,
under a name that says which rank and run wrote it.

[Note: direct I/O] With ``O_DIRECT`` the kernel moves data between the device and the
caller's buffer without the page cache, which is the point of swapping: the page cache would
otherwise hold a second copy of the states in RAM. It requires the file offset, the length
and the buffer address of every request to be multiples of the logical block size; every
region here starts at a multiple of ``ALIGNMENT`` (4096, the largest common block size),
its length is rounded up to one, and ``aligned_buffer`` returns 4096-aligned host memory.
File systems without ``O_DIRECT`` (``ramfs``; ``tmpfs`` before Linux 6.6) refuse the open
with ``EINVAL``.
"""

from __future__ import annotations

import errno
import os
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from zcomm.quant.cpu_kernels import shared_array

from ._config import AioConfig

ALIGNMENT = 4096


def round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def aligned_buffer(nbytes: int, *, pin_memory: bool = False) -> torch.Tensor:
    """``nbytes`` (a multiple of ``ALIGNMENT``) of uint8 host memory starting at an aligned address."""
    raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=pin_memory)
    start = -raw.data_ptr() % ALIGNMENT
    return raw[start : start + nbytes]


def _remove(fd: int, path: str) -> None:
    try:
        os.close(fd)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class SwapFile:
    """``nbytes`` of swap space for this rank under ``directory``, used by offset.

    ``read(offset, buffer)`` / ``write(offset, buffer)`` start a transfer of the whole
    aligned ``buffer`` and return a handle whose ``wait()`` returns when it is done (and
    raises what the I/O raised). A transfer is split into ``aio.block_size`` requests run on
    a pool of ``aio.thread_count * aio.queue_depth`` threads (``os.preadv``/``os.pwritev``
    release the GIL), so that many requests are in flight at once.
    """

    def __init__(self, directory: str, *, rank: int, nbytes: int, aio: AioConfig,
                 holds: str = "optimizer states") -> None:
        """``holds`` names the contents in the file's name and in errors: ``"optimizer states"``
        (``offload_optimizer``) or ``"parameters"`` (``offload_param``)."""
        root = Path(directory)
        if not root.is_dir():
            raise ValueError(f"offload nvme_path {directory!r} is not an existing directory")
        if not os.access(root, os.W_OK | os.X_OK):
            raise ValueError(f"offload nvme_path {directory!r} is not writable by this process")
        kind = "param" if holds == "parameters" else "offload"
        self.path = str(root / f"zero_{kind}_rank{rank:05d}_{uuid.uuid4().hex[:12]}.swap")
        self.nbytes = round_up(max(nbytes, 1))
        self.direct, fd = self._open(aio.zcomm_direct_io)
        self._finalizer = weakref.finalize(self, _remove, fd, self.path)
        self.fd = fd
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as err:
            self.close()
            room = "has no room for" if err.errno in (errno.ENOSPC, errno.EDQUOT) else "cannot reserve"
            raise ValueError(f"offload nvme_path {directory!r} {room} this rank's {self.nbytes / 2**20:.1f} MiB "
                             f"of {holds} ({os.strerror(err.errno)})") from None
        self.block_size = aio.block_size
        self._pool = ThreadPoolExecutor(aio.thread_count * aio.queue_depth, thread_name_prefix="zero-swap")

    def _open(self, direct: bool | str) -> tuple[bool, int]:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        if direct is not False:
            try:
                return True, os.open(self.path, flags | os.O_DIRECT, 0o600)
            except OSError as err:
                if err.errno != errno.EINVAL:
                    raise ValueError(f"cannot create the swap file {self.path}: {err.strerror}") from None
                Path(self.path).unlink(missing_ok=True)  # some file systems create it before refusing
                if direct is True:
                    raise ValueError(f"aio.zcomm_direct_io is true, but the file system of {self.path!r} does not "
                                     "allow O_DIRECT (e.g. ramfs): use a directory on a block device, or set "
                                     "zcomm_direct_io to 'auto' or false") from None
        try:
            return False, os.open(self.path, flags, 0o600)
        except OSError as err:
            raise ValueError(f"cannot create the swap file {self.path}: {err.strerror}") from None

    def read(self, offset: int, buffer: torch.Tensor) -> "Transfer":
        return self._transfer(offset, buffer, write=False)

    def write(self, offset: int, buffer: torch.Tensor) -> "Transfer":
        return self._transfer(offset, buffer, write=True)

    def _transfer(self, offset: int, buffer: torch.Tensor, *, write: bool) -> "Transfer":
        nbytes = buffer.numel()
        assert buffer.dtype == torch.uint8 and buffer.is_contiguous()
        assert offset % ALIGNMENT == 0 and nbytes % ALIGNMENT == 0 and buffer.data_ptr() % ALIGNMENT == 0
        assert offset + nbytes <= self.nbytes, "transfer beyond the swap file"
        view = memoryview(shared_array(buffer))
        io = os.pwritev if write else os.preadv
        futures = [self._pool.submit(_whole, io, self.fd, view[start : start + self.block_size], offset + start)
                   for start in range(0, nbytes, self.block_size)]
        return Transfer(futures, keep=buffer)

    def close(self) -> None:
        """Wait for the transfers in flight, then remove the file (idempotent)."""
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)
        self._finalizer()


def _whole(io, fd: int, view: memoryview, offset: int) -> None:
    """One request, repeated until all of ``view`` is transferred (short reads and writes)."""
    done = 0
    while done < len(view):
        count = io(fd, [view[done:]], offset + done)
        if count == 0:
            raise OSError(errno.EIO, f"swap file ended at byte {offset + done}")
        done += count


class Transfer:
    """An asynchronous read or write of one buffer; holds the buffer until ``wait``."""

    def __init__(self, futures: list[Future], keep: torch.Tensor) -> None:
        self._futures = futures
        self._keep = keep

    def done(self) -> bool:
        return all(future.done() for future in self._futures)

    def wait(self) -> None:
        for future in self._futures:
            future.result()
        self._keep = None
